"""`kvconvert mla`: stream a Llama-family checkpoint layer by layer into a stock DeepSeek-V3 MLA
checkpoint. Only one decoder layer's weights plus the embeddings and the calibration hidden
states are in memory at a time.

--device: the calibration hidden states live there, and each layer's weights are copied there
for its closed form (float64 eigen problems and solves) and its forward; the converted weights
come back to the host to be written. The embeddings and the writes stay on the host.
"""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvconvert import kvmath
from kvconvert.checkpoint import (CheckpointReader, CheckpointWriter, check_output_path, ensure_free_space,
                                  estimate_checkpoint_bytes)
from kvconvert.checkpoint.fingerprint import checkpoint_fingerprint
from kvconvert.data import calibration_windows, data_hash
from kvconvert.device import resolve_device
from kvconvert.errors import KVConvertError
from kvconvert.kvformat import torch_dtype, weight_dtype
from kvconvert.mla import deepseek_format as fmt
from kvconvert.mla.convert_layer import LayerPlan, convert_layer, max_rank
from kvconvert.mla.options import MLAOptions
from kvconvert.models import deepseek_v3 as ds, llama
from kvconvert.models.common import DecoderLayer, rms_norm, take
from kvconvert.models.deepseek_v3 import MLAShape
from kvconvert.models.llama import LlamaShape
from kvconvert.models.registry import COPIED_LAYER_TENSORS, SOURCE_ATTENTION, TARGET_ATTENTION
from kvconvert.targets import check_servable

@dataclass
class ConversionReport:
    source: str
    options: dict
    config: dict
    layers: list = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    calib_tokens: int = 0
    calib_hash: str = ""


def validate_plan(cfg: dict, opts: MLAOptions) -> tuple[int, int]:
    """(head_dim, rope_dim) after checking rank and rope-dim against the source; errors say the limits."""
    fmt.check_source_config(cfg)
    d = kvmath.head_dim(cfg)
    rope_dim = opts.rope_dim if opts.rope_dim is not None else min(64, d)
    if rope_dim <= 0 or rope_dim % 2:
        raise KVConvertError(f"--rope-dim {rope_dim}: must be a positive even number")
    if rope_dim > d or (d // 2) % (rope_dim // 2):
        valid = [2 * s for s in range(1, d // 2 + 1) if (d // 2) % s == 0]
        raise KVConvertError(f"--rope-dim {rope_dim}: must divide the head_dim {d} into whole frequency groups; valid: {valid}")
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    top = max_rank(kv_heads, d, rope_dim)
    if not 1 <= opts.rank <= top:
        raise KVConvertError(f"--rank {opts.rank}: must be between 1 and {top} (2 x kv_heads x head_dim - rope_dim) for this model")
    check_servable(opts.target, opts.rank, rope_dim, kv_heads, d)
    if opts.q_rank is not None:
        q_rows = cfg["num_attention_heads"] * (min(d, opts.rank) + rope_dim)
        top_q = min(cfg["hidden_size"], q_rows)
        if not 1 <= opts.q_rank <= top_q:
            raise KVConvertError(f"--q-rank {opts.q_rank}: must be between 1 and {top_q} for this model")
    return d, rope_dim


def source_layer_weights(reader: CheckpointReader, i: int, part: str) -> dict:
    """One layer's source tensors, copied out of the map: part "attention" = q/k/v/o_proj in
    float64 plus both norms; part "mlp" = the MLP in the source dtype (7B: 0.5 GB in fp32), read
    only after the attention math so the two never sit in memory together."""
    if part == "attention":
        w = {k: reader.get(v.format(i=i), torch.float64) for k, v in SOURCE_ATTENTION.items()}
        names = [n for n in COPIED_LAYER_TENSORS if "layernorm" in n]
    else:
        w, names = {}, [n for n in COPIED_LAYER_TENSORS if ".mlp." in n]
    for src in names:
        w[src.split(".")[-2]] = reader.get(src.format(i=i))  # source dtype; cast per use
    for name, t in w.items():
        if not torch.isfinite(t).all():
            raise KVConvertError(f"layer {i} {name}: source weights contain NaN or inf; the checkpoint is broken")
    return w


def _check_finite(t: torch.Tensor, what: str) -> None:
    if not torch.isfinite(t).all():
        raise KVConvertError(f"{what}: activations became NaN/inf during calibration; check the source checkpoint and data")


def convert_to_mla(src_path: Path, out_dir: Path, opts: MLAOptions, source_name: str | None = None,
                   overwrite: bool = False, progress: bool = True) -> ConversionReport:
    t0 = time.time()
    device = resolve_device(opts.device)
    reader = CheckpointReader(src_path)
    cfg = reader.config
    d, rope_dim = validate_plan(cfg, opts)
    check_output_path(Path(out_dir), overwrite)
    ensure_free_space(Path(out_dir), int(estimate_checkpoint_bytes(src_path, weight_dtype(opts.dtype).bytes, untie=True)
                                         * 1.2))  # lm_head written as its own copy; 1.2: MLA attention size
    plan = LayerPlan.for_source(d, opts.rank, rope_dim, key_weight=opts.key_weight, rho=opts.rho)
    source = LlamaShape.from_config(cfg)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src_path))
    ids = calibration_windows(tokenizer, opts.calib_data, opts.calib_tokens, opts.calib_window)
    out_cfg = fmt.deepseek_config(cfg, plan.rank, rope_dim, plan.nope_dim, plan.v_dim, opts.q_rank,
                                  weight_dtype(opts.dtype).torch_name)
    target = MLAShape.from_config(out_cfg)
    report = ConversionReport(source=source_name or str(src_path), options=opts.model_dump(), config=out_cfg,
                              calib_tokens=int(ids.numel()), calib_hash=data_hash(ids))
    out_dtype = torch_dtype(opts.dtype)
    embed = reader.get("model.embed_tokens.weight")
    hidden = embed[ids].float().to(device)  # [N, T, hidden] calibration hidden states, carried layer to layer
    with CheckpointWriter(out_dir, overwrite=overwrite, source=report.source, max_shard_bytes=256 * 2**20,
                          manifest_extra={"kvconvert_mla": {"rank": plan.rank, "rope_dim": rope_dim,
                                                            "calib_tokens": report.calib_tokens,
                                                            "calib_hash": report.calib_hash,
                                                            # heal checks its --teacher against it
                                                            "source_fingerprint": checkpoint_fingerprint(src_path)}}
                          ) as writer:
        writer.add("model.embed_tokens.weight", embed.to(out_dtype))
        del embed  # only one layer plus the hidden states stay in memory from here on
        reader.close()  # reader.get copies out of the map: unmap now, mapped file pages count in RSS
        layers = range(cfg["num_hidden_layers"])
        for i in tqdm(layers, desc="mla: layers", disable=not progress):
            w = source_layer_weights(reader, i, "attention")
            reader.close()  # copied out: drop the mapped pages before the heavy math (they count in RSS)
            mla_w, layer_rep, hidden = _convert_and_advance(hidden, w, source, target, plan, opts, i,
                                                            load_mlp=lambda: source_layer_weights(reader, i, "mlp"))
            reader.close()
            for short, name in TARGET_ATTENTION.items():
                if short in mla_w:
                    writer.add(name.format(i=i), mla_w[short].to(out_dtype).cpu())
            for src_name, dst_name in COPIED_LAYER_TENSORS.items():
                writer.add(dst_name.format(i=i), w[src_name.split(".")[-2]].to(out_dtype))
            report.layers.append(layer_rep)
            del w, mla_w
        writer.add("model.norm.weight", reader.get("model.norm.weight").to(out_dtype))
        lm_head_name = "lm_head.weight" if "lm_head.weight" in reader else "model.embed_tokens.weight"
        lm_head = reader.get(lm_head_name)  # tied sources: written explicitly (DeepSeek-V3 unties)
        writer.add("lm_head.weight", lm_head.to(out_dtype))
        writer.write_config(out_cfg)
        writer.copy_tokenizer(src_path)
        report.seconds = time.time() - t0
        report.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        writer.write_json("conversion_report.json", asdict(report))
        try:
            from kvconvert.mla.plots import plot_spectra

            plot_spectra(report, writer.tmp_dir / "spectra.png")
        except ImportError:
            pass
    return report


def _convert_and_advance(hidden, w, source: LlamaShape, target: MLAShape, plan: LayerPlan, opts: MLAOptions, i: int,
                         load_mlp):
    """Convert layer i and advance the calibration hidden states [N, T, hidden] through it.

    w: the layer's attention weights and norms (host); load_mlp() returns its MLP weights, which are
    added to w once the attention is converted (--stream converted: through the converted attention).
    The maths runs on hidden's device, with a copy of w there; the weights returned stay there."""
    on_device = {k: v.to(hidden.device) for k, v in w.items()}
    xn = rms_norm(hidden, on_device["input_layernorm"], source.rms_eps)  # [N, T, hidden] fp32
    _check_finite(xn, f"layer {i} input")
    result = convert_layer(xn, on_device, source, target, plan, opts.q_rank, opts.refit_o_proj, layer=i)
    mlp = load_mlp()
    w.update(mlp)
    on_device.update({k: v.to(hidden.device) for k, v in mlp.items()})
    layer = DecoderLayer.of(on_device, llama.LlamaAttention)
    if opts.stream == "converted":
        h = hidden + ds.attention(xn, take(ds.MLAAttention, {k: v.float() for k, v in result.weights.items()}), target)
        hidden = h + layer.mlp(rms_norm(h, layer.post_attention_layernorm, source.rms_eps))
    else:
        hidden = llama.layer(hidden, layer, source)
    _check_finite(hidden, f"layer {i} output")
    return result.weights, result.report, hidden
