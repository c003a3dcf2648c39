"""In-kernel dequant helpers vs kvconvert.number_formats, bit for bit (interpreter on CPU, compiled on GPU).

Tolerance: none. Every E2M1 code decodes to exactly the spec value, and e2m1 * e4m3 block scale,
computed in fp16 in the kernel, equals the fp32 product of the reference for every (code, scale)
pair (the product is exact in fp16: a 2-bit by 4-bit significand within [2^-10, 2688]).
"""

from __future__ import annotations

import torch

from kvconvert import number_formats as F

from kernel_cases import DEVICE, triton  # first: skips without Triton

from kvconvert.kernels._triton_compat import tl
from kvconvert.kernels.dequant import e2m1_code_to_f16, e2m1_code_to_f16_tiny, quantize_rows_e4m3


@triton.jit
def _decode_products_kernel(codes_ptr, scales_ptr, out_ptr, N: tl.constexpr):
    """out[i] = e2m1(codes[i]) * scales[i] as the decode kernels compute it (fp16 product)."""
    offs = tl.arange(0, N)
    codes = tl.load(codes_ptr + offs).to(tl.int32)
    s = tl.load(scales_ptr + offs).to(tl.float32).to(tl.float16)
    tl.store(out_ptr + offs, (e2m1_code_to_f16(codes) * s).to(tl.float32))


def test_e2m1_decode_times_every_e4m3_scale_is_exact():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    e4m3 = bits.float()
    e4m3 = e4m3[torch.isfinite(e4m3) & (e4m3 >= 0)]  # all 127 non-negative finite e4m3 block scales
    codes = torch.arange(16, dtype=torch.uint8)
    grid_codes = codes.repeat_interleave(len(e4m3))
    grid_scales = e4m3.repeat(16)
    n = triton.next_power_of_2(len(grid_codes))
    pad = n - len(grid_codes)
    codes_in = torch.cat([grid_codes, torch.zeros(pad, dtype=torch.uint8)]).to(DEVICE)
    scales_in = torch.cat([grid_scales, torch.zeros(pad)]).to(torch.float8_e4m3fn).to(DEVICE)
    out = torch.full((n,), float("nan"), device=DEVICE)
    _decode_products_kernel[(1,)](codes_in, scales_in, out, N=n)
    expected = F.e2m1_decode(grid_codes) * grid_scales
    assert torch.equal(out[: len(grid_codes)].cpu(), expected)


@triton.jit
def _tiny_products_kernel(codes_ptr, scales_ptr, out_f16_ptr, out_bf16_ptr, N: tl.constexpr):
    """The word-planes NVFP4 decode (e2m1 * 2^-14 times the block scale in fp16), widened to fp32 straight and
    through bf16 (the bf16 dots' operand)."""
    offs = tl.arange(0, N)
    s = tl.load(scales_ptr + offs).to(tl.float32).to(tl.float16)
    product = e2m1_code_to_f16_tiny(tl.load(codes_ptr + offs).to(tl.int32)) * s
    tl.store(out_f16_ptr + offs, product.to(tl.float32))
    tl.store(out_bf16_ptr + offs, product.to(tl.bfloat16).to(tl.float32))


def test_word_planes_tiny_e2m1_products_are_exact():
    """word_planes' NVFP4 values: e2m1 * 2^-14 * block scale in fp16 (fp16 subnormals down to 2^-24) is exact for
    every (code, e4m3 scale), and stays exact as a bf16 operand: times 2^14 it is the reference's product."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    e4m3 = bits.float()
    e4m3 = e4m3[torch.isfinite(e4m3) & (e4m3 >= 0)]
    grid_codes = torch.arange(16, dtype=torch.uint8).repeat_interleave(len(e4m3))
    grid_scales = e4m3.repeat(16)
    n = triton.next_power_of_2(len(grid_codes))
    pad = n - len(grid_codes)
    codes_in = torch.cat([grid_codes, torch.zeros(pad, dtype=torch.uint8)]).to(DEVICE)
    scales_in = torch.cat([grid_scales, torch.zeros(pad)]).to(torch.float8_e4m3fn).to(DEVICE)
    out_f16, out_bf16 = (torch.full((n,), float("nan"), device=DEVICE) for _ in range(2))
    _tiny_products_kernel[(1,)](codes_in, scales_in, out_f16, out_bf16, N=n)
    expected = F.e2m1_decode(grid_codes) * grid_scales
    for out in (out_f16, out_bf16):
        assert torch.equal(out[: len(grid_codes)].cpu() * 16384.0, expected)


@triton.jit
def _fp8_word_bytes_kernel(words_ptr, lo_ptr, hi_ptr, N: tl.constexpr):
    """The word-planes fp8 decode: each int16 word's low and high e4m3 byte as fp16 (load_fp8_byte_planes)."""
    offs = tl.arange(0, N)
    w = tl.load(words_ptr + offs).to(tl.int32)
    tl.store(lo_ptr + offs, (w & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.float32))
    tl.store(hi_ptr + offs, ((w >> 8) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.float32))


def test_word_planes_fp8_bytes_decode_exactly():
    """Every finite e4m3 code, in the low and the high byte of an int16 word (the high byte's sign bit is the
    word's), decodes to its value exactly."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = values[torch.isfinite(values.float())]
    lo, hi = values, values.view(torch.uint8).flip(0).view(torch.float8_e4m3fn)
    words = torch.stack([lo.view(torch.uint8), hi.view(torch.uint8)], -1).reshape(-1).view(torch.int16)
    n = triton.next_power_of_2(len(words))
    words_in = torch.cat([words, torch.zeros(n - len(words), dtype=torch.int16)]).to(DEVICE)
    out_lo, out_hi = (torch.full((n,), float("nan"), device=DEVICE) for _ in range(2))
    _fp8_word_bytes_kernel[(1,)](words_in, out_lo, out_hi, N=n)
    assert torch.equal(out_lo[: len(words)].cpu(), lo.float()) and torch.equal(out_hi[: len(words)].cpu(), hi.float())


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, ROWS: tl.constexpr, D: tl.constexpr):
    """codes, scales = quantize_rows_e4m3(x) for x fp32 [ROWS, D], as the fp8-dot kernels quantize queries."""
    offs = tl.arange(0, ROWS)[:, None] * D + tl.arange(0, D)[None, :]
    codes, scales = quantize_rows_e4m3(tl.load(x_ptr + offs))
    tl.store(codes_ptr + offs, codes)
    tl.store(scales_ptr + tl.arange(0, ROWS), scales)


def test_query_rows_e4m3_quantizer_is_bit_exact():
    """The fp8-dot kernels' per-head query quantizer equals formats.fp8_tile_quantize with one tile per
    row (scale amax / 448, RNE), code for code and scale for scale. The rows cover every binade of
    e4m3 and its subnormals, values that round up into the next binade (the interpreter's own cast
    gets 127.9 -> 64 wrong), ties, signed zeros and an all-zero row (scale 1 in the kernel, 0 in
    formats)."""
    torch.manual_seed(0)
    rows, d = 16, 64
    x = torch.randn(rows, d) * torch.logspace(-3, 3, rows)[:, None]
    x[1] = torch.linspace(-448, 448, d)
    x[2] = torch.linspace(-0.02, 0.02, d) * 448 / 0.02
    x[2, 0] = 448.0
    x[3, :8] = torch.tensor([127.9, -127.9, 31.99, 7.999, 0.0157, 0.0156, 0.00195, 448.0])
    x[4] = 0.0
    x[5, :5] = torch.tensor([448.0, 8.5, -2.125, 0.0029296875, -0.0])  # ties to even: 8, -2, 2^-8 (subnormal); -0
    codes = torch.zeros(rows, d, dtype=torch.float8_e4m3fn, device=DEVICE)
    scales = torch.zeros(rows, device=DEVICE)
    _quantize_rows_kernel[(1,)](x.to(DEVICE), codes, scales, ROWS=rows, D=d)
    ref_codes, ref_scales = F.fp8_tile_quantize(x, tile=d)
    assert torch.equal(codes.cpu().view(torch.uint8), ref_codes.view(torch.uint8))
    nonzero = ref_scales[:, 0] > 0
    assert torch.equal(scales.cpu()[nonzero], ref_scales[nonzero, 0]) and float(scales[4]) == 1.0
