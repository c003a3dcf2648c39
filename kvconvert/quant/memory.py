"""Memory `kvconvert calibrate` needs, estimated from config.json before any work, and the check
that refuses a run the machine cannot hold (rather than being killed by the kernel halfway).

The layer-streamed path (kvconvert.quant.stream) holds at once:
* the calibration hidden states, fp32 [tokens, hidden] - the only term that grows with tokens;
* the embedding matrix once, in the stored dtype, while the first hidden states are gathered;
* one decoder layer: attention in fp32, plus float64 copies while a rotation is folded (q/k for
  the key phases, v/o for the value rotation), and the MLP in the stored dtype with one matrix cast
  to fp32 at a time;
* one batch of activations: the MLP's gate/up/product [batch tokens, intermediate] fp32 and the
  attention's q/k/v (k/v repeated over the query heads of a group) and outputs;
* the mse search's kept windows (queries, cached tensors, reference outputs);
* the interpreter, torch and the tokenizer (BASE_BYTES, measured: about 0.45 GB for SmolLM2).
Numbers are upper estimates (temporaries counted as coexisting); SAFETY covers the allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import stored_bytes

GB = 1e9
BASE_BYTES = int(0.6 * GB)  # python + torch + transformers + tokenizer, before any tensor
SAFETY = 1.15
FP32 = 4


@dataclass(frozen=True)
class MemoryEstimate:
    fixed: int  # bytes that do not depend on the calibration tokens
    per_token: int  # bytes per calibration token (the hidden states)
    tokens: int

    @property
    def total(self) -> int:
        return int(SAFETY * (self.fixed + self.per_token * self.tokens))

    def tokens_that_fit(self, available: int) -> int:
        """Most calibration tokens that fit in `available` bytes (0: none, or tokens do not matter)."""
        if self.per_token <= 0:
            return 0
        return max(0, int((available / SAFETY - self.fixed) / self.per_token))


def _dims(cfg: dict) -> dict:
    cfg = cfg.get("text_config", cfg)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    d = dict(hidden=hidden, heads=heads, inter=int(cfg.get("intermediate_size") or 4 * hidden),
             vocab=int(cfg.get("vocab_size") or 0), layers=int(cfg["num_hidden_layers"]),
             stored=stored_bytes(cfg.get("torch_dtype") or cfg.get("dtype")))
    if cfg.get("kv_lora_rank"):  # DeepSeek-V3 MLA
        names = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        rank, rope, nope, v = (int(cfg[name]) for name in names)
        q_rank, qk = cfg.get("q_lora_rank"), nope + rope
        q_params = hidden * heads * qk if not q_rank else int(q_rank) * (hidden + heads * qk)
        d.update(attn_params=q_params + hidden * (rank + rope) + rank * heads * (nope + v) + heads * v * hidden,
                 q_width=heads * qk, kv_width=heads * (qk + v), cache_width=rank + rope, out_width=heads * v, kinds=1)
        d["rotated_params"] = d["attn_params"]  # small: every MLA rewrite touches most of it
    else:
        kv = int(cfg.get("num_key_value_heads") or heads)
        hd = int(cfg.get("head_dim") or hidden // heads)
        d.update(attn_params=2 * hidden * heads * hd + 2 * hidden * kv * hd, q_width=heads * hd,
                 kv_width=2 * heads * hd, cache_width=2 * kv * hd, out_width=heads * hd, kinds=2 * kv,
                 qk_params=hidden * (heads + kv) * hd, vo_params=hidden * (heads + kv) * hd)
    return d


def calibration_memory(config: dict, tokens: int, window_len: int, batch_size: int, search_tokens: int,
                       key_phase: bool = True, value_rotation: bool = False) -> MemoryEstimate:
    """Peak bytes of the layer-streamed calibration (see the module docstring), from config.json.

    key_phase / value_rotation: which rewrites are folded (q/k, v/o projections of GQA; all of MLA's
    attention): each is rewritten through three float64 copies (input, pair gathers, output)."""
    d = _dims(config)
    batch = batch_size * window_len
    if "rotated_params" in d:
        rotated = d["rotated_params"] if key_phase or value_rotation else 0
    else:
        rotated = d["qk_params"] * key_phase + d["vo_params"] * value_rotation
    attention = d["attn_params"] * FP32 + rotated * 3 * 8
    mlp = 3 * d["hidden"] * d["inter"] * d["stored"] + d["hidden"] * d["inter"] * FP32  # + one cast matrix
    layer = max(attention + mlp, d["vocab"] * d["hidden"] * d["stored"])  # the embedding only at the start
    # q, post-RoPE copies, k/v repeated over the group, sdpa output, residual, norms: ~3 x each width
    attn_act = batch * (3 * d["q_width"] + 2 * d["kv_width"] + 2 * d["cache_width"] + 4 * d["hidden"]) * FP32
    mlp_act = batch * (4 * d["inter"] + 3 * d["hidden"]) * FP32
    search = search_tokens * (d["q_width"] + d["cache_width"] + 2 * d["out_width"] + d["kv_width"]) * FP32 * 2
    observers = d["layers"] * d["kinds"] * 2 * 4096 * 8  # histograms per head and per tensor
    return MemoryEstimate(fixed=BASE_BYTES + layer + max(attn_act, mlp_act) + search + observers,
                          per_token=d["hidden"] * FP32, tokens=tokens)


def check_calibration_memory(est: MemoryEstimate, available: int | None, window_len: int, batch_size: int) -> None:
    """Refuse (KVConvertError) when the estimate exceeds the available memory, naming what would fit."""
    if available is None or est.total <= available:
        return
    fit = est.tokens_that_fit(available) // window_len * window_len
    if fit >= window_len:
        hint = f"use --calib-tokens {fit} or fewer"
    elif batch_size > 1:
        hint = "use --batch-size 1 and fewer --calib-tokens"
    else:
        hint = "free memory or use a larger machine"
    raise KVConvertError(
        f"calibration needs about {est.total / GB:.1f} GB ({est.tokens} tokens x {est.per_token} bytes of hidden "
        f"states + {est.fixed / GB:.1f} GB for one layer, one batch and the runtime) but only "
        f"{available / GB:.1f} GB is available: {hint}")


def release_heap(generation: int = 2) -> None:
    """Collect garbage and hand freed heap back to the OS. glibc keeps a layer loop's freed blocks
    in its arenas otherwise: TinyLlama calibrate (amax, 1024 tokens) peaked at 1.86 GB without this
    before its export, 1.33 GB with it (docs/calibrate.md). generation: the oldest generation collected;
    a loop whose objects die young passes 1 (a full collection walks every object of the process,
    transformers' included: ~0.2 s each, ~6 s of a 30-layer calibration; the young ones take ~0.5 ms)."""
    import ctypes
    import gc

    gc.collect(generation)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
