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
* the interpreter, torch and the tokenizer (kvconvert.memory.CALIBRATE_OVERHEAD, measured: about 0.45 GB
  for SmolLM2).
Numbers are upper estimates (temporaries counted as coexisting); CALIBRATE_SAFETY covers the allocator.
The estimate is kvconvert.memory's MemoryEstimate: the layer is its `weights`, the batch its `activations`,
the search windows and histograms its `buffers`, the hidden states its `per_token` x `tokens`.
"""

from __future__ import annotations

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import stored_bytes
from kvconvert.memory import CALIBRATE_OVERHEAD, CALIBRATE_SAFETY, MemoryEstimate

GB = 1e9
FP32 = 4


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
    return MemoryEstimate(weights=layer, activations=max(attn_act, mlp_act), buffers=search + observers,
                          per_token=d["hidden"] * FP32, tokens=tokens, overhead=CALIBRATE_OVERHEAD,
                          safety=CALIBRATE_SAFETY)


def whole_model_memory(config: dict, parameters: int, tokens: int, window_len: int, batch_size: int) -> MemoryEstimate:
    """Calibration through the whole transformers model (architectures the streamed blocks do not cover):
    the fp32 model (4 bytes per stored parameter) plus a batch's logits and activations (8 x vocab per
    token); the calibration tokens add nothing the model does not hold already."""
    vocab = int(config.get("vocab_size") or 0)
    return MemoryEstimate(weights=4 * parameters, activations=8 * batch_size * window_len * vocab, tokens=tokens,
                          overhead=CALIBRATE_OVERHEAD, safety=CALIBRATE_SAFETY)


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
    raise KVConvertError(f"calibration needs about {est.describe()} but only {available / GB:.1f} GB is available: "
                         f"{hint}")


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
