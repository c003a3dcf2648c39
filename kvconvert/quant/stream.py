"""Layer-streamed calibration: the calibration forward runs one decoder layer at a time.

Only the embeddings' rows of the calibration tokens, the hidden states [windows, T, hidden] (fp32,
carried from layer to layer), one layer's weights and one batch of activations are in memory:
1. hidden = embed_tokens[ids] (the embedding matrix is read, indexed and dropped);
2. per layer: its weights are read from safetensors in their stored dtype (the mapped pages are
   dropped right after, they count in RSS); the attention weights are cast to fp32 (the whole-model
   path's precision), the MLP stays in the stored dtype and is cast per matmul;
   a. rotation planning (optional): the post-RoPE q/k pair moments (pair_stats) of the first 8
      windows at this layer's input give the key phases, which are folded into this layer's
      q/k weights (rotate.RotationPlan.apply, the same code the export uses);
   b. every window, in batches: the cached tensors (Llama: post-RoPE K, V; DeepSeek-V3: the latent
      after kv_a_layernorm and the post-RoPE k_rope) go through the observers; the first windows'
      queries and cached tensors are kept for the mse search; the hidden states advance through
      attention + MLP;
   c. this layer's scales: observer statistic / 448, or the attention-output search
      (search.BlockReplay on the kept windows);
3. the scales and the rotation plan go to the export, which rewrites the weights file by file.
Devices: the hidden states and each layer's weights live on `device`, so the forward (step b, the
bulk of the time) and the pair moments run there; the observers, the float64 rotation rewrite and
the mse search get host copies (what they return goes to the export) and run on the host as before.
The model maths are kvconvert.models' (llama, deepseek_v3), shared with `kvconvert mla`, the
healing code and the runtime. Rotations are exact, so the hidden states after a rotated
layer equal the unrotated ones up to fp32 rounding, and every layer's statistics equal those of
the whole-model path (calibrate.calibrate_model, the reference in tests) to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvmath import KVShape
from kvconvert.models.registry import SOURCE_MODEL_TYPES as GQA_MODEL_TYPES
from kvconvert.models import deepseek_v3 as ds, llama
from kvconvert.models.common import MLP, rms_norm, short_names, take
from kvconvert.quant.fake_quant import mla_row_from_engine, mla_row_to_engine
from kvconvert.quant.latent_shape import LatentMoments
from kvconvert.quant.observers import KVObserver, layer_observers, observing_hook
from kvconvert.quant.pair_stats import STAT_WINDOWS, PairMoments, PairMomentSums, complex_pairs
from kvconvert.quant.rotate import RotationPlan
from kvconvert.quant.search import BlockReplay


def stream_unsupported(config: dict, layout: KVShape) -> str | None:
    """Why the functional blocks cannot run this checkpoint (None: they can)."""
    cfg = config.get("text_config", config)
    mt = cfg.get("model_type")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        return "attention/MLP biases"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.get('hidden_act')!r}"
    if layout.is_mla:
        if int(cfg.get("first_k_dense_replace", 0)) < layout.num_layers:
            return "mixture-of-experts layers"
        return None
    if mt not in GQA_MODEL_TYPES:
        return f"model_type {mt!r} (the streamed path knows {', '.join(sorted(GQA_MODEL_TYPES))} and deepseek_v3)"
    if mt == "mistral" and cfg.get("sliding_window") not in (None, 0):
        return "sliding-window attention"
    return None


class _Family:
    """One architecture's layer maths (kvconvert.models) in the calibration's terms.

    attention weights: names relative to self_attn ("q_proj.weight", ...), as RotationPlan.apply
    takes them; cache(xn, w) -> (q, k, v) with k, v in transformers' cache layout (what the cache
    hooks see, see capture.py) and q what attend reads; attend(q, k, v, w) -> [B, T, heads * v_dim].
    """

    attention: tuple[str, ...]

    def __init__(self, layout: KVShape, shape):
        self.layout, self.shape, self.rms_eps = layout, shape, shape.rms_eps


class _LlamaFamily(_Family):
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")

    def cache(self, xn, w):
        return llama.qkv(xn, take(llama.LlamaAttention, short_names(w)), self.shape)

    def attend(self, q, k, v, w):
        return llama.attend(q, k, v, self.shape)

    def pairs(self, q, k, v):
        """complex128 post-RoPE pairs q [b, T, H, d/2], k [b, T, G, d/2] (pair_stats conventions)."""
        return complex_pairs(q.transpose(1, 2), False), complex_pairs(k.transpose(1, 2), False)


class _MLAFamily(_Family):
    attention = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                 "kv_b_proj", "o_proj")

    def cache(self, xn, w):
        a = take(ds.MLAAttention, short_names(w))
        latent, k_rope = ds.latent(xn, a, self.shape)  # k_rope in the weights' (engine) pair order
        row = torch.cat([latent, k_rope], dim=-1)[:, None]  # engine row [B, 1, T, r + R]
        latent_hf, k_rope_hf = mla_row_from_engine(row, self.layout.kv_lora_rank, self.layout.rope_interleave)
        return ds.query(xn, a, self.shape), latent_hf, k_rope_hf

    def attend(self, q, latent_hf, k_rope_hf, w):
        row = mla_row_to_engine(latent_hf, k_rope_hf, self.layout.rope_interleave)[:, 0]
        rank = self.layout.kv_lora_rank
        return ds.attend(q, row[..., :rank], row[..., rank:], take(ds.MLAAttention, short_names(w)), self.shape)

    def pairs(self, q, latent_hf, k_rope_hf):
        """complex128 post-RoPE pairs of the queries' rope dims [b, T, H, R/2] and k_rope [b, T, 1, R/2]."""
        inter = self.layout.rope_interleave
        row = mla_row_to_engine(latent_hf, k_rope_hf, inter)[..., self.layout.kv_lora_rank:]
        q_rope = q[..., -self.layout.qk_rope_head_dim:]
        return complex_pairs(q_rope.transpose(1, 2), inter), complex_pairs(row.transpose(1, 2), inter)


class LayerStream:
    """Reads a checkpoint layer by layer and runs calibration windows through it (see module doc)."""

    def __init__(self, reader, layout: KVShape, windows: torch.Tensor, batch_size: int,
                 device: torch.device | str = "cpu"):
        self.reader, self.layout, self.batch_size, self.device = reader, layout, batch_size, torch.device(device)
        self.family = (_MLAFamily(layout, ds.MLAShape.from_config(reader.config)) if layout.is_mla
                       else _LlamaFamily(layout, llama.LlamaShape.from_config(reader.config)))
        embed = reader.get("model.embed_tokens.weight")
        self.hidden = embed[windows].float().to(self.device)  # [N, T, hidden]: the only activations kept across layers
        del embed
        reader.close()  # drop the mapped pages (file-backed pages count in RSS)

    def read_layer(self, i: int) -> tuple[dict, dict]:
        """(attention weights in fp32, named relative to self_attn; norms and MLP in the stored dtype),
        on the stream's device."""
        prefix = f"model.layers.{i}."
        attn = {}
        for short in self.family.attention:
            name = f"{prefix}self_attn.{short}.weight"
            if name in self.reader:
                attn[f"{short}.weight"] = self.reader.get(name, torch.float32).to(self.device)
        rest = {n: self.reader.get(f"{prefix}{n}.weight") for n in ("input_layernorm", "post_attention_layernorm")}
        rest.update({n: self.reader.get(f"{prefix}mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")})
        rest = {n: t.to(self.device) for n, t in rest.items()}
        self.reader.close()
        return attn, rest

    def batches(self, stop: int | None = None):
        n = self.hidden.shape[0] if stop is None else min(stop, self.hidden.shape[0])
        for start in range(0, n, self.batch_size):
            yield start, min(start + self.batch_size, n)

    @torch.no_grad()
    def statistics(self, i: int, attn: dict, rest: dict, key_phase: bool, key_obs: bool):
        """Pair moments (on the host) and/or K observers of the first STAT_WINDOWS windows at layer i (unrotated)."""
        sums = PairMomentSums(self.layout) if key_phase else None
        obs = layer_observers(self.layout, histograms=False) if key_obs else None  # key amax per channel only
        for a, b in self.batches(STAT_WINDOWS):
            q, k, v = self.family.cache(rms_norm(self.hidden[a:b], rest["input_layernorm"], self.family.rms_eps), attn)
            if sums is not None:
                sums.add(i, *self.family.pairs(q, k, v))
            if obs is not None:
                observing_hook(self.layout, lambda _: obs)(i, k, v)
        moments = sums.layer_result(i) if sums else None
        if moments is not None:
            moments = PairMoments(**{f.name: getattr(moments, f.name).cpu() for f in fields(moments)})
        return moments, obs

    @torch.no_grad()
    def latent_moments(self, i: int, attn: dict, rest: dict) -> LatentMoments:
        """MLA: pre-norm latent moments (kv_a_proj_with_mqa's first rank outputs) of the first STAT_WINDOWS
        windows at layer i, unrotated (kvconvert.quant.latent_shape)."""
        rank = self.layout.kv_lora_rank
        kv_a, bias = attn["kv_a_proj_with_mqa.weight"][:rank], attn.get("kv_a_proj_with_mqa.bias")
        moments = LatentMoments.empty(rank)
        for a, b in self.batches(STAT_WINDOWS):
            c = rms_norm(self.hidden[a:b], rest["input_layernorm"], self.family.rms_eps) @ kv_a.T
            moments.add(c if bias is None else c + bias[:rank], self.family.shape.latent_eps)
        return moments

    @torch.no_grad()
    def advance(self, i: int, attn: dict, rest: dict, record_windows: int,
                histograms: bool = True) -> tuple[dict[str, KVObserver], list[dict]]:
        """Observe layer i's cache on every window (histograms: for the percentile observer), keep the first
        windows' records, and replace the hidden states by the layer's output."""
        obs, records = layer_observers(self.layout, histograms), []
        eps, o_proj = self.family.rms_eps, attn["o_proj.weight"]
        for a, b in self.batches():
            h = self.hidden[a:b]
            q, k, v = self.family.cache(rms_norm(h, rest["input_layernorm"], eps), attn)
            observing_hook(self.layout, lambda _: obs)(i, k, v)
            if a < record_windows:  # a batch can run past the kept windows: keep only those (batch first)
                keep = min(b, record_windows) - a
                records.append({"q": q[:keep].cpu(), "k": k[:keep].cpu(), "v": v[:keep].cpu()})  # search on the host
            h = h + self.family.attend(q, k, v, attn) @ o_proj.T
            del q, k, v
            h = h + take(MLP, rest)(rms_norm(h, rest["post_attention_layernorm"], eps))
            if not bool(torch.isfinite(h).all()):
                raise KVConvertError(f"layer {i}: the hidden states became NaN/inf during calibration; "
                                     "the checkpoint or the calibration data is broken at this layer")
            self.hidden[a:b] = h
        return obs, records

    def replay(self, attn: dict, records: list[dict], kv_dtype: str) -> BlockReplay:
        attn = {k: v.cpu() for k, v in attn.items()}  # the records are on the host
        return BlockReplay(records, lambda q, k, v: self.family.attend(q, k, v, attn), attn["o_proj.weight"],
                           self.layout, kv_dtype)


def apply_rotation(plan: RotationPlan, layer: int, attn: dict, num_q_heads: int) -> dict:
    """attn with the plan's rewrite of `layer` folded in (fp32 in, fp32 out; math in float64 on the
    host, the plan's device; the result goes back to attn's device).

    Only the tensors the rewrite reads are passed (it works on float64 copies: a 7B layer's four
    projections would be 0.5 GB)."""
    names = list(attn)
    if not plan.layout.is_mla:
        names = (("v_proj.weight", "o_proj.weight") if plan.value_rotation is not None else ()) + \
                (("q_proj.weight", "k_proj.weight") if plan.key_pair_factor is not None else ())
    device = attn["o_proj.weight"].device
    changed = plan.apply(layer, {n: attn[n].cpu() for n in names}, num_q_heads)
    return {**attn, **{n: t.to(device) for n, t in changed.items()}}
