"""Quantize-dequantize ("fake quant") of what the engine caches, bit-exact with kvconvert.number_formats.

Scale convention (kvconvert.kvformat): the exported ``k_scale`` / ``v_scale`` is ``amax / 448`` for
FP8 E4M3 and NVFP4 (``amax / 57344`` for FP8 E5M2, ``amax / 127`` for INT8). FP8 stores ``fp8(x / scale)``;
INT8 ``sat_s8(rne(x * (1 / scale)))`` (TensorRT-LLM's); NVFP4 uses the global dequant scale ``scale / 6`` and
E4M3 block scales over blocks of 16 along the last dim.

Tensor layout here is transformers' cache layout ``[batch, heads, tokens, dim]``; a per-head scale
is ``[heads]`` and is broadcast as ``[heads, 1, 1]``.

MLA rows: the engine caches ``[latent | k_rope]`` per token (one "head"). With
``rope_interleave=True`` transformers hands the cache k_rope de-interleaved (``[x0, x2, .., x1, x3, ..]``)
while the engine (vLLM's non-neox rotary) stores the weights' interleaved order ``[x0, x1, x2, ..]``.
NVFP4 blocks of 16 group different values in the two orders, so rows are quantized in the engine's
order: :func:`mla_row_to_engine` / :func:`mla_row_from_engine`.
"""

from __future__ import annotations

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import CALIBRATE_KV_DTYPES, KVFormat, kv_format
from kvconvert import number_formats as F


def check_kv_dtype(kv_dtype: str) -> KVFormat:
    """The format of a calibrated kv_dtype (fp8, fp8_e5m2, int8, nvfp4, ...); KVConvertError for any other."""
    if kv_dtype not in CALIBRATE_KV_DTYPES:
        raise KVConvertError(f"unknown kv-dtype {kv_dtype!r}: use one of {', '.join(CALIBRATE_KV_DTYPES)}")
    return kv_format(kv_dtype)


def scale_from_amax(amax: torch.Tensor | float, kv_dtype: str):
    """Exported scale for a KV amax: amax/448 for fp8 (E4M3) and nvfp4, amax/57344 for fp8_e5m2, amax/127 for int8."""
    return check_kv_dtype(kv_dtype).scale_from_amax(amax)


def _head_broadcast(scale: torch.Tensor | float, x: torch.Tensor) -> torch.Tensor:
    """Scale [] or [heads] -> tensor broadcastable to x [batch, heads, tokens, dim]."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if s.dim() == 0:
        return s
    if s.dim() != 1 or s.numel() != x.shape[1]:
        raise KVConvertError(f"per-head scale of shape {tuple(s.shape)} does not match {x.shape[1]} heads")
    return s.view(-1, 1, 1)


def fake_quant(x: torch.Tensor, kv_dtype: str, scale: torch.Tensor | float, rounding: str = "nearest") -> torch.Tensor:
    """Quantize-dequantize x [batch, heads, tokens, dim] as the engine stores it; same dtype out.

    scale: exported scale (python float, 0-d tensor, or [heads] per head). FP8 rounds x/scale to the
    format (saturating; `rounding`: "nearest" = RNE, "toward_zero" = vLLM's CPU cache write, see
    formats.fp8_quantize); INT8 as number_formats.int8_quantize; NVFP4 quantizes blocks of 16 along dim with
    global scale scale/6.
    """
    fmt = check_kv_dtype(kv_dtype)
    s = _head_broadcast(scale, x)
    if fmt.integer:  # int8: one code per value, the engine's reciprocal product
        return F.int8_dequantize(F.int8_quantize(x, s), s).to(x.dtype)
    if fmt.torch_dtype:  # fp8: one code per value
        q = F.fp8_quantize(x, s, getattr(torch, fmt.torch_dtype), rounding)
        return F.fp8_dequantize(q, s).to(x.dtype)
    g = F.nvfp4_global_scale_from_kv_scale(s)
    packed, block_scales = F.nvfp4_quantize(x, g)
    return F.nvfp4_dequantize(packed, block_scales, g).to(x.dtype)


def fake_quant_row(x: torch.Tensor, kv_dtype: str, scale: torch.Tensor | float, rope_tail: int = 0,
                   rounding: str = "nearest") -> torch.Tensor:
    """Quantize-dequantize one cached tensor as the engine stores it (:func:`fake_quant`), where an MLA
    row [latent | k_rope] (engine order) may keep its last `rope_tail` values (KVFormat.rope_tail) apart:
    k_rope in the format's ``mla_rope`` ("bf16": rounded to bf16; "fp8": e4m3 with the same kv scale)."""
    if not rope_tail:
        return fake_quant(x, kv_dtype, scale, rounding)
    rope_format = check_kv_dtype(kv_dtype).mla_rope
    latent, rope = fake_quant(x[..., :-rope_tail], kv_dtype, scale), x[..., -rope_tail:]
    if rope_format == "bf16":
        return torch.cat([latent, rope.to(torch.bfloat16).to(x.dtype)], dim=-1)
    return torch.cat([latent, fake_quant(rope, rope_format, scale)], dim=-1)


def mla_row_to_engine(latent: torch.Tensor, k_rope: torch.Tensor, rope_interleave: bool) -> torch.Tensor:
    """HF cache tensors latent [b,1,T,R], k_rope [b,1,T,r] -> engine row [b,1,T,R+r]."""
    if rope_interleave:
        half = k_rope.shape[-1] // 2
        k_rope = torch.stack((k_rope[..., :half], k_rope[..., half:]), dim=-1).flatten(-2)
    return torch.cat((latent, k_rope), dim=-1)


def mla_row_from_engine(row: torch.Tensor, kv_lora_rank: int, rope_interleave: bool):
    """Inverse of :func:`mla_row_to_engine`: row [b,1,T,R+r] -> (latent, k_rope) in HF order."""
    latent, k_rope = row[..., :kv_lora_rank], row[..., kv_lora_rank:]
    if rope_interleave:
        k_rope = torch.cat((k_rope[..., 0::2], k_rope[..., 1::2]), dim=-1)
    return latent, k_rope
