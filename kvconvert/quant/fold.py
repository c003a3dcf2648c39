"""Fold calibrated KV scales into the weights, so an engine that ignores the scales still stores
what the calibrated scale would have stored.

An engine with a static FP8/NVFP4 KV cache stores q(x / s). vLLM 0.32 loads no KV scale at all for
DeepSeek MLA (it then uses s = 1.0), other engines read theirs under other names: a scale left in
the checkpoint alone is honoured by some engines only. The cached tensor itself can be rescaled
instead: with f = 2^ceil(log2 s), the weights that produce the cache are divided by f and the
weights that read it are multiplied by f, so every full-precision output is unchanged, and

* an engine that ignores the scale stores q(x / f): the same values up to a power of two, with
  amax / f in (224, 448] for FP8 (no overflow; FP8/NVFP4 rounding is relative, so a power of two
  away from the calibrated scale changes only the subnormal corner);
* an engine that reads the remaining scale r = s / f (in (0.5, 1], written under every name as
  before) stores q((x / f) / r) = q(x / s) exactly: both divisions are by powers of two apart.

Powers of two keep bf16/fp16 weights exact (only the exponent changes).

An engine that stores K and V of a layer at one scale, max(k_scale, v_scale) (TensorRT-LLM's INT8 cache:
kvformat's shared_kv_scale), would coarsen the smaller of the two by up to their ratio (SmolLM2 layer 0: K's
amax 10.8, V's 0.6). With K and V scales a power of two apart (:func:`tied_candidates`: one of them moved by
less than a factor 2, a factor sqrt(2) at most when the nearer candidate wins) both fold to the same remaining
scale, so the one scale the engine applies is each one's own.

Producers and readers:

* Llama GQA, K (post-RoPE; RoPE is linear): k_proj (and its bias) / f_k, q_proj (and bias) * f_k.
* Llama GQA, V: v_proj (and bias) / f_v, o_proj * f_v (its input is linear in V).
* DeepSeek MLA, the one cached row [latent | k_rope] with one scale: kv_a_layernorm.weight / f
  (the cached latent is taken after the norm) and kv_b_proj * f; the k_rope rows of
  kv_a_proj_with_mqa / f and the query's rope rows (q_proj or q_b_proj) * f.
"""

from __future__ import annotations

import math

import torch

from kvconvert.kvmath import KVShape
from kvconvert.quant.scales import KVScales


def fold_factor(scale: torch.Tensor) -> float:
    """2^ceil(log2(max scale)): the power of two folded into the weights (per tensor; for per-head
    scales the largest head's, so every head's remaining scale is <= 1)."""
    return 2.0 ** math.ceil(math.log2(float(scale.max())))


def tied_candidates(k: torch.Tensor, v: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-tensor (k, v) scale pairs a power of two apart, each with one of the two moved to the nearest power of
    two times the other, below or above (module docstring); smallest product first, no duplicates."""
    if k.numel() != 1 or v.numel() != 1:
        raise ValueError("one scale for K and V per layer: per-tensor scales only")
    ratio = math.log2(float(v) / float(k))  # Python's libm: the same choice on every CPU
    pairs = {}
    for m in sorted({math.floor(ratio), math.ceil(ratio)}):
        f = torch.tensor(2.0 ** m, dtype=torch.float32)
        for pair in ((k, k * f), (v / f, v)):  # a power of two: exact in fp32
            pairs.setdefault((float(pair[0]), float(pair[1])), pair)
    return sorted(pairs.values(), key=lambda kv: float(kv[0]) * float(kv[1]))


def fold_plan(scales: KVScales) -> tuple[list[tuple[float, float]], KVScales]:
    """([(f_k, f_v)] per layer, the remaining scales s / f). MLA: f_k == f_v (one row scale)."""
    factors = [(fold_factor(k), fold_factor(v)) for k, v in zip(scales.k, scales.v)]
    remaining = KVScales(scales.kv_dtype, scales.granularity, scales.layout_kind,
                         [k / fk for k, (fk, _) in zip(scales.k, factors)],
                         [v / fv for v, (_, fv) in zip(scales.v, factors)])
    return factors, remaining


def _scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    return t * torch.tensor(factor, dtype=t.dtype)  # a power of two: exact in the stored dtype


def _scale_rope_rows(w: torch.Tensor, heads: int, rope: int, factor: float) -> torch.Tensor:
    """Query weight [heads * (nope + rope), in] with each head's last `rope` rows times factor."""
    per_head = w.view(heads, -1, w.shape[-1]).clone()
    per_head[:, -rope:] = _scaled(per_head[:, -rope:], factor)
    return per_head.view_as(w)


def fold_layer(local: dict[str, torch.Tensor], layout: KVShape, f_k: float, f_v: float) -> dict[str, torch.Tensor]:
    """The layer's attention tensors (names relative to ``self_attn.``, e.g. ``k_proj.weight``)
    that change when the cache is divided by (f_k, f_v); the others are left out."""
    if layout.is_mla:
        return _fold_mla(local, layout, f_k)
    out = {}
    for name, t in local.items():
        module = name.split(".")[0]
        factor = {"k_proj": 1 / f_k, "q_proj": f_k, "v_proj": 1 / f_v}.get(module)
        if module == "o_proj" and name.endswith("weight"):
            factor = f_v  # o_proj's bias is added after the product: unchanged
        if factor is not None and factor != 1.0:
            out[name] = _scaled(t, factor)
    return out


def _fold_mla(local: dict[str, torch.Tensor], layout: KVShape, f: float) -> dict[str, torch.Tensor]:
    if f == 1.0:
        return {}
    rank, rope, heads = layout.kv_lora_rank, layout.qk_rope_head_dim, layout.num_heads
    kv_a = local["kv_a_proj_with_mqa.weight"].clone()
    kv_a[rank:] = _scaled(kv_a[rank:], 1 / f)
    q_name = "q_b_proj.weight" if "q_b_proj.weight" in local else "q_proj.weight"
    return {
        "kv_a_proj_with_mqa.weight": kv_a,
        "kv_a_layernorm.weight": _scaled(local["kv_a_layernorm.weight"], 1 / f),
        "kv_b_proj.weight": _scaled(local["kv_b_proj.weight"], f),
        q_name: _scale_rope_rows(local[q_name], heads, rope, f),
    }
