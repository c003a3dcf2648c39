"""In-kernel dequant helpers vs kvconvert.quant.formats, bit for bit (interpreter on CPU, compiled on GPU).

Tolerance: none. Every E2M1 code decodes to exactly the spec value, and e2m1 * e4m3 block scale,
computed in fp16 in the kernel, equals the fp32 product of the reference for every (code, scale)
pair (the product is exact in fp16: a 2-bit by 4-bit significand within [2^-10, 2688]).
"""

from __future__ import annotations

import torch

from kvconvert.quant import formats as F

from kernel_cases import DEVICE, triton  # first: skips without Triton

from kvconvert.kernels._triton_compat import tl
from kvconvert.kernels.dequant import e2m1_code_to_f16


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
