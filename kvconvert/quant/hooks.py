"""Cache hooks that store K/V as the engine does: quantize-dequantize each cached row with the
calibrated scales (kvconvert.quant.fake_quant), or leave it as it is.

A hook goes to quant.capture.forward_with_hook (or the runtime's and vLLM's runners); what the model
then attends to is the rounded cache, including, in a prefill, the current window's own keys, as in
a paged engine that writes the cache and then attends from it. kvconvert.eval.kv_quant scores
candidates run this way.
"""

from __future__ import annotations

import torch

from kvconvert.kvformat import kv_format, kv_pair
from kvconvert.kvmath import KVShape
from kvconvert.quant.capture import CacheHook, cache_hook, check_finite
from kvconvert.quant.fake_quant import fake_quant_row
from kvconvert.quant.scales import KVScales


def fake_quant_hook(layout: KVShape, scales: KVScales, rounding: str = "nearest") -> CacheHook:
    """Cache hook that quantize-dequantizes every cached tensor with `scales` (FP8 `rounding`:
    kvconvert.number_formats.fp8_quantize)."""
    # MLA + NVFP4 stores k_rope apart (16-bit or FP8), as kvconvert.runtime and kvconvert.kernels do
    rope_tail = kv_format(scales.kv_dtype).rope_tail(layout.is_mla, layout.qk_rope_head_dim)

    def row_hook(layer_idx: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        check_finite(layer_idx, kind, x)
        return fake_quant_row(x, scales.kv_dtype, scales.scale(layer_idx, kind), rope_tail, rounding)
    return cache_hook(layout, row_hook)


def llamacpp_hook(layout: KVShape, kv_dtype: str, rotate: bool | None = None) -> CacheHook:
    """Cache hook that stores every cached tensor as llama.cpp does in a `kv_dtype` cache (one of its types, or a
    K/V pair of them, q5_0/iq4_nl: kvconvert.ggml_formats), in its frame: K's channels in its interleaved RoPE order, the Hadamard rotation
    (`rotate` None: as llama.cpp decides, on unless LLAMA_ATTN_ROT_DISABLE reads as a non-zero number), blocks of 32 with fp16 scales set
    per block as rows are written (no calibrated scale)."""
    from kvconvert.ggml_formats import llamacpp_frames

    pair = kv_pair(kv_dtype)
    if not pair.ggml_types:
        raise ValueError(f"{kv_dtype} is not one of llama.cpp's cache types")
    pair.check_cache_kind(layout.is_mla)
    frames = llamacpp_frames(*pair.ggml_types, layout.row_dim, layout.is_mla, rotate)

    def row_hook(layer_idx: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        check_finite(layer_idx, kind, x)
        return frames[kind].fake_quant(x)
    return cache_hook(layout, row_hook)


def identity_hook(layer_idx, key, value):
    """The cache stored as it is (the unquantized baseline)."""
    return key, value
