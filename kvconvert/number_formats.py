"""KV-cache number formats: FP8 (E4M3 / E5M2), NVFP4 and INT8, as bit-exact pure-PyTorch references.

A floor module (it imports only errors and kvformat): calibration's fake quantization
(kvconvert.quant.fake_quant), the runtime's cache and the kernels' references all round through it.

Conventions (docs/formats.md, "KV-cache number formats and scales"):

* FP8, static scale: ``q = fp8(clamp(x / scale, -max, max))`` with round-to-nearest-even (torch's
  float8 cast), ``x_hat = float(q) * scale``. ``scale = amax / 448`` for E4M3. ``scale`` is a python
  float (per tensor) or a tensor broadcastable to ``x`` (e.g. per head: x ``[tokens, heads, D]`` with
  scale ``[heads, 1]``).
* NVFP4: blocks of 16 values along the last dim. Each block gets one E4M3 scale ``s_b``; the tensor
  (or head) gets one fp32 *dequant* global scale ``g = amax / (6 * 448)``::

      s_b  = e4m3(min(amax(|block|) / 6 / g, 448))          (RNE cast)
      code = E2M1_rne(x / (float(s_b) * g))                (saturating at 6; 0 if s_b == 0)
      x_hat = (E2M1_VALUES[code & 7] * float(s_b)) * g     (first product exact, one rounding)

  Codes are 4 bits: bit 3 = sign (IEEE sign bit of x, so -0.0 and tiny negatives give 0x8),
  bits 0-2 = index into E2M1_VALUES. Two codes per byte: element 2i in the LOW nibble, 2i+1 in the
  HIGH nibble. Packed ``uint8 [..., D // 2]``, block scales ``float8_e4m3fn [..., D // 16]``.
* INT8, static scale (TensorRT-LLM's cache write, docs/engines.md "INT8 KV cache"):
  ``q = sat_s8(rne(x * fp32(1 / scale)))``: the product in fp32 with the scale's fp32 reciprocal (the
  kernel multiplies by kv_scale_orig_quant = 1 / kv_cache_scaling_factor; ``x / scale`` rounds differently
  near ties), then PTX ``cvt.rni.sat.s8.f32``: round half to even, saturating to [-128, 127].
  ``x_hat = float(q) * scale`` in fp32. ``scale = amax / 127``.
* Exported checkpoint scales (``k_scale`` / ``v_scale``) are ``amax / 448`` for both FP8 and NVFP4
  (ModelOpt >= 0.42 / TensorRT-LLM); the NVFP4 global scale is that divided by 6; ``amax / 127`` for INT8.

Every quantizer rejects NaN input with KVConvertError. Scales must be positive and finite.
"""

from __future__ import annotations

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import E2M1_MAX, FP8_E4M3_MAX, FP8_E5M2_MAX, NVFP4_BLOCK

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

FP8_DTYPE = torch.float8_e4m3fn  # e4m3: what an FP8 KV cache stores and the kernels read (e5m2 is the other FP8)
FP8_MAX = {FP8_DTYPE: FP8_E4M3_MAX, torch.float8_e5m2: FP8_E5M2_MAX}

# RNE onto the E2M1 grid: code = number of decision thresholds |y| passes. At a midpoint the tie
# goes to the even code, so the threshold is inclusive (>=) where the upper neighbour's code is
# even and exclusive (>) where the lower one's is. Pairs: (midpoint, upper code is even).
_E2M1_THRESHOLDS = (
    (0.25, False),  # 0   | 0.5  -> tie to code 0
    (0.75, True),  # 0.5 | 1    -> tie to code 2
    (1.25, False),  # 1   | 1.5  -> tie to code 2
    (1.75, True),  # 1.5 | 2    -> tie to code 4
    (2.5, False),  # 2   | 3    -> tie to code 4
    (3.5, True),  # 3   | 4    -> tie to code 6
    (5.0, False),  # 4   | 6    -> tie to code 6
)


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------


def _reject_nan(x: torch.Tensor, what: str) -> None:
    if x.is_floating_point() and bool(torch.isnan(x).any()):
        raise KVConvertError(f"{what} contains NaN: fix the producer of this tensor before quantizing")


def _fp8_max(dtype: torch.dtype) -> float:
    if dtype not in FP8_MAX:
        raise KVConvertError(f"unsupported FP8 dtype {dtype}: use torch.float8_e4m3fn or torch.float8_e5m2")
    return FP8_MAX[dtype]


def _as_scale(scale: float | torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """A positive finite fp32 scale tensor (0-d for a python float)."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=device)
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise KVConvertError(
            f"{what} must be positive and finite (got min {float(s.min()):g}): "
            "an all-zero or missing calibration gives a bad scale; recalibrate"
        )
    return s


# ----------------------------------------------------------------------------------------------
# scale conventions
# ----------------------------------------------------------------------------------------------


def nvfp4_global_scale_from_kv_scale(kv_scale: float | torch.Tensor):
    """NVFP4 dequant global scale from an exported kv scale: ``kv_scale / 6`` (= amax / (6*448))."""
    return kv_scale / E2M1_MAX


# ----------------------------------------------------------------------------------------------
# FP8
# ----------------------------------------------------------------------------------------------


FP8_ROUNDINGS = ("nearest", "toward_zero")


def fp8_quantize(
    x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
    rounding: str = "nearest",
) -> torch.Tensor:
    """``fp8(clamp(x / scale, -max, max))``. x any float ``[...]``; scale float or broadcastable.

    rounding "nearest": round-to-nearest-even (torch's cast; GPU engines' satfinite cvt).
    "toward_zero": the mantissa truncated, as vLLM's CPU cache write stores FP8
    (kvconvert.engines.vllm.VLLM_CPU_FP8_ROUNDING, docs/engines.md)."""
    fmax = _fp8_max(dtype)
    if rounding not in FP8_ROUNDINGS:
        raise KVConvertError(f"unknown fp8 rounding {rounding!r}: use one of {', '.join(FP8_ROUNDINGS)}")
    _reject_nan(x, "fp8_quantize input")
    s = _as_scale(scale, x.device, "fp8 scale")
    # Clamp before the cast: on CUDA an out-of-range float8_e4m3fn cast gives NaN, not max.
    y = (x.float() / s).clamp(-fmax, fmax)
    if rounding == "toward_zero" and dtype == torch.float8_e4m3fn:
        # vLLM's kernel reads the code off the fp32 bits of y * 2^-120; below 2^-6 (E4M3's
        # subnormals) that product is an fp32 subnormal, itself rounded to a multiple of 2^-149.
        y = torch.where(y.abs() < 2.0 ** -6, torch.round(y * 2.0 ** 29) / 2.0 ** 29, y)
    q = y.to(dtype)
    if rounding == "toward_zero":
        # FP8 magnitude codes grow with the value, so where RNE rounded |y| up the code one below
        # is the truncated value (never below 0: a code rounded up from y is > 0).
        up = q.float().abs() > y.abs()
        q = (q.view(torch.uint8) - up.to(torch.uint8)).view(dtype)
    return q


def fp8_dequantize(
    q: torch.Tensor, scale: float | torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``float(q) * scale`` in fp32, then cast to ``out_dtype``. q float8 ``[...]``."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return (q.float() * s).to(out_dtype)


def fp8_tile_quantize(
    x: torch.Tensor, tile: int = 128, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile dynamic FP8 (FlashMLA-like): one fp32 scale ``amax(|tile|) / max`` per ``tile`` values.

    x ``[..., D]`` with ``D % tile == 0`` -> (q ``dtype [..., D]``, scales ``float32 [..., D // tile]``).
    An all-zero tile gets scale 0 and codes 0 (dequantizes to 0, no NaN).
    """
    fmax = _fp8_max(dtype)
    _reject_nan(x, "fp8_tile_quantize input")
    d = x.shape[-1]
    if tile <= 0 or d % tile:
        raise KVConvertError(f"last dim {d} is not a multiple of the FP8 tile {tile}: pick a tile that divides it")
    tiles = x.float().reshape(*x.shape[:-1], d // tile, tile)
    scales = tiles.abs().amax(-1) / fmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (tiles / safe[..., None]).clamp(-fmax, fmax).to(dtype)
    return q.reshape(x.shape), scales


def fp8_tile_dequantize(
    q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`fp8_tile_quantize`: q ``[..., D]``, scales ``[..., D // tile]`` -> ``[..., D]``."""
    d, n_tiles = q.shape[-1], scales.shape[-1]
    if n_tiles == 0 or d % n_tiles:
        raise KVConvertError(f"fp8 tile scales {tuple(scales.shape)} do not tile a last dim of {d}")
    tiles = q.float().reshape(*q.shape[:-1], n_tiles, d // n_tiles)
    return (tiles * scales.float()[..., None]).reshape(q.shape).to(out_dtype)


# ----------------------------------------------------------------------------------------------
# INT8
# ----------------------------------------------------------------------------------------------

INT8_MIN, INT8_MAX = -128, 127  # cvt.rni.sat.s8's range: a clipped negative value may reach -128


def int8_quantize(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``sat_s8(rne(x * fp32(1 / scale)))`` -> int8, as TensorRT-LLM's INT8 cache stores x. x any float ``[...]``;
    scale float or broadcastable (e.g. ``[heads, 1]`` for x ``[tokens, heads, D]``)."""
    _reject_nan(x, "int8_quantize input")
    s = _as_scale(scale, x.device, "int8 scale")
    # the kernel's quant scale is the reciprocal, one correctly rounded fp32 division, then one fp32 product;
    # torch.round is half-to-even; an infinite product (tiny scale) saturates like cvt.sat
    y = x.float() * (1.0 / s)
    return torch.round(y).clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def int8_dequantize(
    q: torch.Tensor, scale: float | torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``float(q) * scale`` in fp32 (exact codes, one rounding), then cast to ``out_dtype``. q int8 ``[...]``."""
    if q.dtype != torch.int8:
        raise KVConvertError(f"INT8 codes must be torch.int8, got {q.dtype}")
    s = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return (q.float() * s).to(out_dtype)


# ----------------------------------------------------------------------------------------------
# E2M1 codes and nibble packing
# ----------------------------------------------------------------------------------------------


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """RNE (ties to even code) of already-scaled values onto E2M1, saturating at +-6 -> uint8 codes.

    y float ``[...]`` -> uint8 ``[...]`` in 0..15; bit 3 = sign bit of y, bits 0-2 = magnitude index.
    """
    _reject_nan(y, "e2m1_encode input")
    mag = y.float().abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for midpoint, tie_up in _E2M1_THRESHOLDS:
        passed = (mag >= midpoint) if tie_up else (mag > midpoint)
        code += passed.to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[...]`` (0..15) -> float32 E2M1 values ``[...]`` (code 8 decodes to -0.0)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = lut[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (D even) -> uint8 ``[..., D // 2]``; element 2i low nibble, 2i+1 high."""
    if codes.shape[-1] % 2:
        raise KVConvertError(f"cannot pack an odd last dim {codes.shape[-1]} into nibbles")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., D // 2]`` -> uint8 codes ``[..., D]`` (inverse of :func:`pack_nibbles`)."""
    if packed.dtype != torch.uint8:
        raise KVConvertError(f"packed NVFP4 data must be uint8, got {packed.dtype}")
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------


def _blocks(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    if d % NVFP4_BLOCK:
        raise KVConvertError(f"NVFP4 needs the last dim to be a multiple of {NVFP4_BLOCK}, got {d}")
    return x.float().reshape(*x.shape[:-1], d // NVFP4_BLOCK, NVFP4_BLOCK)


def nvfp4_quantize(
    x: torch.Tensor, global_scale: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4: x ``[..., D]`` -> (packed ``uint8 [..., D//2]``, block scales ``float8_e4m3fn [..., D//16]``).

    ``global_scale`` is the dequant global scale (amax / (6*448)): float, or a tensor broadcastable
    against ``x[..., :1]`` (per tensor, or per head such as ``[heads, 1]`` for x ``[T, heads, D]``).
    """
    _reject_nan(x, "nvfp4 input")
    g = _as_scale(global_scale, x.device, "nvfp4 global scale")
    blocks = _blocks(x)
    # E4M3 block scales s_b = e4m3(min(amax(|block|) / 6 / g, 448)): [..., D//16]
    block_scales = (blocks.abs().amax(-1) / E2M1_MAX / g).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    effective = block_scales.float() * g  # [..., D//16]
    # A zero block scale (all-zero block, or one too small for e4m3) encodes the block as zeros.
    safe = torch.where(effective > 0, effective, torch.ones_like(effective))
    scaled = torch.where(effective[..., None] > 0, blocks / safe[..., None], torch.zeros_like(blocks))
    codes = e2m1_encode(scaled).reshape(x.shape)
    return pack_nibbles(codes), block_scales


def nvfp4_dequantize(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: float | torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(E2M1 value * float(s_b)) * g``: packed ``uint8 [..., D//2]`` + scales ``[..., D//16]`` -> ``[..., D]``."""
    values = e2m1_decode(unpack_nibbles(packed))
    d = values.shape[-1]
    if block_scales.shape[-1] * NVFP4_BLOCK != d:
        raise KVConvertError(
            f"NVFP4 block scales last dim {block_scales.shape[-1]} does not match {d} values (need D/16)"
        )
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    blocks = values.reshape(*values.shape[:-1], d // NVFP4_BLOCK, NVFP4_BLOCK)
    # value * s_b is exact in fp32 (2 + 4 significant bits); the global scale adds one rounding.
    out = (blocks * block_scales.float()[..., None]).reshape(values.shape) * g
    return out.to(out_dtype)

