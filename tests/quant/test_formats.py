"""Bit-exactness of the FP8 / NVFP4 references against brute-force oracles and hand-worked examples."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import kv_format
from kvconvert import number_formats as F

FINITE = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


# ----------------------------------------------------------------------------------------------
# oracles: nearest representable value by exhaustive search, ties to the even code
# ----------------------------------------------------------------------------------------------


def _e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """All finite e4m3fn values and their 8-bit codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(values)
    return values[finite].double(), codes[finite].int()


def _nearest_rne(y: torch.Tensor, values: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid value to each y (float64); a tie goes to the even code."""
    dist = (y.double()[:, None] - values[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    # prefer even codes among the tied candidates, then any (there are at most 2 distinct values,
    # plus +0/-0 duplicates which decode equal)
    even = candidates & (codes[None, :] % 2 == 0)
    pick = torch.where(even.any(1, keepdim=True), even, candidates)
    return pick.float().argmax(dim=1)


def _e4m3_oracle(y: torch.Tensor) -> torch.Tensor:
    values, codes = _e4m3_table()
    y = y.double().clamp(-448, 448)
    return values[_nearest_rne(y, values, codes)].float()


def _e2m1_oracle_codes(y: torch.Tensor) -> torch.Tensor:
    mags = torch.tensor(F.E2M1_VALUES, dtype=torch.float64)
    idx = _nearest_rne(y.double().abs().clamp(max=6.0), mags, torch.arange(8))
    return idx.to(torch.uint8) | (torch.signbit(y).to(torch.uint8) << 3)


# ----------------------------------------------------------------------------------------------
# FP8
# ----------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(FINITE, min_size=1, max_size=64), st.floats(min_value=1e-4, max_value=1e3))
def test_fp8_e4m3_matches_oracle_and_half_ulp(xs, scale):
    x = torch.tensor(xs, dtype=torch.float32)
    q = F.fp8_quantize(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    y = x / torch.tensor(scale, dtype=torch.float32)
    assert torch.equal(q.float(), _e4m3_oracle(y))
    # half-ULP bound for in-range values: normals have 3 mantissa bits, subnormal step is 2^-9
    inrange = y.abs() <= 448
    ulp = torch.where(y.abs() >= 2**-6, 2.0 ** (torch.floor(torch.log2(y.abs().clamp(min=2**-6))) - 3), 2.0**-9)
    err = (F.fp8_dequantize(q, scale) - x).abs()
    assert bool((err[inrange] <= (0.5 * ulp * scale * (1 + 1e-6))[inrange]).all())


def test_fp8_saturates_instead_of_nan():
    x = torch.tensor([1e9, -1e9, 449.0, -500.0, float("inf"), float("-inf")])
    q = F.fp8_quantize(x, 1.0)
    assert q.float().tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, -448.0]
    q5 = F.fp8_quantize(torch.tensor([1e9, -6e4]), 1.0, dtype=torch.float8_e5m2)
    assert q5.float().tolist() == [57344.0, -57344.0]


def test_fp8_ties_to_even_by_hand():
    # e4m3 around 1: step 1/8. 1 + 1/16 is the midpoint of 1.0 (mantissa 000) and 1.125 (001) -> 1.0
    # 1.125 + 1/16 is the midpoint of 1.125 (001) and 1.25 (010) -> 1.25
    # subnormals: step 2^-9. 2^-10 is the midpoint of 0 and 2^-9 -> 0; 3*2^-10 -> 2^-8 (code 2)
    x = torch.tensor([1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 464.0])
    q = F.fp8_quantize(x, 1.0).float().tolist()
    assert q == [1.0, 1.25, -1.0, 0.0, 2.0**-8, 448.0]


def test_fp8_per_head_scale_broadcast():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 8)
    scale = torch.tensor([0.01, 0.1, 1.0]).reshape(3, 1)
    q = F.fp8_quantize(x, scale)
    for h in range(3):
        assert torch.equal(q[:, h], F.fp8_quantize(x[:, h], float(scale[h])))
    deq = F.fp8_dequantize(q, scale)
    assert torch.equal(deq[:, 1], q[:, 1].float() * scale[1])


def test_fp8_rejects_nan_and_bad_scales():
    with pytest.raises(KVConvertError, match="NaN"):
        F.fp8_quantize(torch.tensor([1.0, float("nan")]), 1.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(KVConvertError, match="scale"):
            F.fp8_quantize(torch.ones(4), bad)
    with pytest.raises(KVConvertError, match="dtype"):
        F.fp8_quantize(torch.ones(4), 1.0, dtype=torch.float16)


def test_fp8_zeros_and_bf16_input():
    assert torch.equal(F.fp8_dequantize(F.fp8_quantize(torch.zeros(7), 0.5), 0.5), torch.zeros(7))
    x = torch.randn(33).bfloat16()
    assert torch.equal(F.fp8_quantize(x, 0.01), F.fp8_quantize(x.float(), 0.01))


def test_fp8_tile_quantize_roundtrip_and_zero_tile():
    torch.manual_seed(1)
    x = torch.randn(4, 256) * torch.tensor([1.0, 100.0]).repeat_interleave(128)
    x[2, :128] = 0
    q, s = F.fp8_tile_quantize(x, 128)
    assert q.shape == x.shape and s.shape == (4, 2) and s[2, 0] == 0
    assert torch.equal(s, x.reshape(4, 2, 128).abs().amax(-1) / 448)
    deq = F.fp8_tile_dequantize(q, s)
    assert torch.equal(deq[2, :128], torch.zeros(128))
    # each tile's relative error is the e4m3 half-ULP (2^-4) of its own amax-scaled grid
    tile_amax = x.reshape(4, 2, 128).abs().amax(-1, keepdim=True)
    err = (deq - x).reshape(4, 2, 128).abs()
    assert bool((err <= tile_amax * 2.0**-4 + 1e-12).all())
    with pytest.raises(KVConvertError, match="tile"):
        F.fp8_tile_quantize(torch.ones(2, 96), 128)


# ----------------------------------------------------------------------------------------------
# E2M1 codes and packing
# ----------------------------------------------------------------------------------------------


def test_e2m1_ties_to_even_by_hand():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, 0.2500001, 100.0])
    # codes: 0.25->0 (0), 0.75->2 (1.0), 1.25->2 (1.0), 1.75->4 (2.0), 2.5->4 (2.0),
    # 3.5->6 (4.0), 5->6 (4.0), 7->7 (saturate 6), -0.75->8|2, just above 0.25 -> 1 (0.5), 100->7
    assert F.e2m1_encode(y).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 10, 1, 7]
    assert F.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist() == [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0
    ]


E2M1_TIES = st.sampled_from([s * v for v in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0) for s in (1, -1)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(min_value=-20, max_value=20, allow_nan=False, width=32), E2M1_TIES), max_size=64))
def test_e2m1_matches_oracle(ys):
    y = torch.tensor(ys, dtype=torch.float32)
    codes = F.e2m1_encode(y)
    assert torch.equal(codes, _e2m1_oracle_codes(y))
    assert torch.equal(F.e2m1_encode(F.e2m1_decode(codes)), codes)  # grid points are fixed points


def test_pack_order_low_nibble_first():
    codes = torch.tensor([0x1, 0x2, 0xF, 0x0, 0x7, 0x8], dtype=torch.uint8)
    packed = F.pack_nibbles(codes)
    assert packed.tolist() == [0x21, 0x0F, 0x87]
    assert torch.equal(F.unpack_nibbles(packed), codes)
    with pytest.raises(KVConvertError):
        F.pack_nibbles(torch.zeros(3, dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------


def test_nvfp4_hand_worked_grid_block():
    # g = 0.5, amax 6 -> s_b = e4m3(6 / 6 / 0.5) = 2.0, effective scale 1.0, so codes read directly.
    x = torch.tensor([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -6])
    packed, scales = F.nvfp4_quantize(x, 0.5)
    assert scales.float().tolist() == [2.0]
    # codes 0,0 | 1,2 | 2,2 | 3,4 | 4,4 | 5,6 | 6,6 | 7,15   (low nibble = even element)
    assert packed.tolist() == [0x00, 0x21, 0x22, 0x43, 0x44, 0x65, 0x66, 0xF7]
    expected = [0, 0, 0.5, 1, 1, 1, 1.5, 2, 2, 2, 3, 4, 4, 4, 6, -6]
    assert F.nvfp4_dequantize(packed, scales, 0.5).tolist() == expected


def test_nvfp4_hand_worked_rounded_block_scale():
    # g = 1: s_b = e4m3(10/6 = 1.667) -> 1.625 (neighbours 1.625, 1.75); effective 1.625.
    # 10/1.625 = 6.15 -> saturates to 6 (-> 9.75); 3.25/1.625 = 2 exactly -> 2 (code 4);
    # 4.0625/1.625 = 2.5 tie -> 2 (code 4); 5.6875/1.625 = 3.5 tie -> 4 (code 6); -0.40625 -> 0.25 tie -> -0
    x = torch.zeros(16)
    x[:5] = torch.tensor([10.0, 3.25, 4.0625, 5.6875, -0.40625])
    packed, scales = F.nvfp4_quantize(x, 1.0)
    assert scales.float().item() == 1.625
    codes = F.unpack_nibbles(packed)
    assert codes[:5].tolist() == [7, 4, 4, 6, 8]
    deq = F.nvfp4_dequantize(packed, scales, 1.0)
    assert deq[:5].tolist() == [9.75, 3.25, 3.25, 6.5, -0.0]


def test_nvfp4_all_zero_block_and_subnormal_scales():
    x = torch.zeros(2, 32)
    # second row: block 0 tiny so s_b is an e4m3 subnormal (< 2^-6), block 1 normal
    x[1, :16] = torch.linspace(-1, 1, 16) * (6 * 2**-8)  # amax/6/g = 2^-8 -> subnormal code 2
    x[1, 16:] = torch.linspace(-1, 1, 16) * 6
    packed, scales = F.nvfp4_quantize(x, 1.0)
    assert scales[0].float().tolist() == [0.0, 0.0] and packed[0].tolist() == [0] * 16
    assert scales[1].float().tolist() == [2.0**-8, 1.0]
    deq = F.nvfp4_dequantize(packed, scales, 1.0)
    assert torch.equal(deq[0], torch.zeros(32)) and not torch.isnan(deq).any()
    # the subnormal-scaled block is quantized on its own grid: error <= half the top step (1.0 * s_b)
    assert bool(((deq[1, :16] - x[1, :16]).abs() <= 1.0 * 2**-8).all())
    # a block too small for any e4m3 scale (s_b underflows to 0) encodes as zeros, not NaN
    tiny = torch.full((16,), 1e-9)
    p, s = F.nvfp4_quantize(tiny, 1.0)
    assert s.float().item() == 0.0 and p.tolist() == [0] * 8


def _nvfp4_oracle(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent NVFP4 encoder built from the e4m3 and e2m1 oracles (x [N, 16*k], per-row g [N, 1])."""
    blocks = x.reshape(x.shape[0], -1, 16)
    scales = _e4m3_oracle((blocks.abs().amax(-1) / 6 / g).flatten()).reshape(blocks.shape[:2])
    eff = scales * g
    y = torch.where(eff[..., None] > 0, blocks / eff.clamp(min=1e-30)[..., None], torch.zeros_like(blocks))
    codes = _e2m1_oracle_codes(y.flatten()).reshape(x.shape)
    return codes, scales


@settings(max_examples=40, deadline=None)
@given(
    st.lists(FINITE, min_size=32, max_size=32),
    st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=2, max_size=2),
)
def test_nvfp4_matches_oracle_per_head(xs, gs):
    x = torch.tensor(xs, dtype=torch.float32).reshape(2, 16)
    g = torch.tensor(gs, dtype=torch.float32).reshape(2, 1)  # one global scale per "head" (row)
    packed, scales = F.nvfp4_quantize(x, g)
    codes, oracle_scales = _nvfp4_oracle(x, g)
    assert torch.equal(scales.float(), oracle_scales)
    assert torch.equal(F.unpack_nibbles(packed), codes)
    deq = F.nvfp4_dequantize(packed, scales, g)
    assert torch.equal(deq, (F.e2m1_decode(codes).reshape(2, 1, 16) * oracle_scales[..., None]).reshape(2, 16) * g)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(min_value=-100, max_value=100, allow_nan=False, width=32), min_size=64, max_size=64))
def test_nvfp4_roundtrip_half_step(xs):
    """|x - x_hat| <= half the E2M1 step at |x| (in scaled units), plus any saturation overshoot."""
    x = torch.tensor(xs).reshape(4, 16)
    # the global scale in float32, as the format stores it: a subnormal-only block (hypothesis found
    # [0, ..., 1.4e-45]) underflows to 0 there, which nvfp4_quantize rightly refuses as a bad calibration
    g = float((x.abs().max() / (6 * 448)).float()) or 1.0
    packed, scales = F.nvfp4_quantize(x, g)
    deq = F.nvfp4_dequantize(packed, scales, g)
    eff = (scales.float() * g).repeat_interleave(16, dim=-1)
    y = torch.where(eff > 0, x / eff.clamp(min=1e-30), torch.zeros_like(x)).abs()
    step = torch.where(y < 2, 0.5, torch.where(y < 4, 1.0, 2.0))
    bound = (0.5 * step + (y - 6).clamp(min=0)) * eff
    ok = (deq - x).abs() <= bound * (1 + 1e-5) + torch.where(eff > 0, 0.0, x.abs())
    assert bool(ok.all())


def test_nvfp4_per_head_broadcast_equals_per_head_calls():
    torch.manual_seed(2)
    x = torch.randn(6, 3, 64) * torch.tensor([0.1, 1.0, 10.0]).reshape(1, 3, 1)
    amax = x.abs().amax(dim=(0, 2)).reshape(3, 1)
    g = F.nvfp4_global_scale_from_kv_scale(kv_format("nvfp4").scale_from_amax(amax))
    packed, scales = F.nvfp4_quantize(x, g)
    assert packed.shape == (6, 3, 32) and scales.shape == (6, 3, 4) and scales.dtype == torch.float8_e4m3fn
    for h in range(3):
        p, s = F.nvfp4_quantize(x[:, h], float(g[h]))
        assert torch.equal(packed[:, h], p) and torch.equal(scales[:, h].float(), s.float())
    deq = F.nvfp4_dequantize(packed, scales, g)
    rel = (deq - x).norm() / x.norm()
    assert rel < 0.15  # typical NVFP4 on Gaussian data: ~9% relative RMS error


def test_nvfp4_rejects_bad_input():
    with pytest.raises(KVConvertError, match="NaN"):
        F.nvfp4_quantize(torch.tensor([math.nan] * 16), 1.0)
    with pytest.raises(KVConvertError, match="multiple of 16"):
        F.nvfp4_quantize(torch.ones(24), 1.0)
    with pytest.raises(KVConvertError, match="global scale"):
        F.nvfp4_quantize(torch.ones(16), 0.0)
    with pytest.raises(KVConvertError, match="D/16"):
        F.nvfp4_dequantize(torch.zeros(8, dtype=torch.uint8), torch.zeros(2, dtype=torch.float8_e4m3fn), 1.0)


# ----------------------------------------------------------------------------------------------
# INT8 (TensorRT-LLM's cache write: cvt.rni.sat.s8.f32 of x * fp32(1 / scale))
# ----------------------------------------------------------------------------------------------


def _int8_oracle(x: float, scale: float) -> int:
    """One value by the engine's steps in exact arithmetic: fp32(1 / scale) and the fp32 product (float64 then one
    rounding to fp32: exact, as float64 holds 2 x 24 bits), Python's round (half to even), saturation."""
    inv = torch.tensor(1.0 / scale, dtype=torch.float64).float().item()
    y = torch.tensor(x * inv, dtype=torch.float64).float().item()
    return 127 if y == math.inf else -128 if y == -math.inf else max(-128, min(127, round(y)))


@settings(max_examples=60, deadline=None)
@given(st.lists(FINITE, min_size=1, max_size=64), st.floats(min_value=2.0 ** -13, max_value=1024.0, width=32))
def test_int8_matches_oracle_and_half_step(xs, scale):
    x = torch.tensor(xs, dtype=torch.float32)
    q = F.int8_quantize(x, scale)
    assert q.dtype == torch.int8
    assert q.tolist() == [_int8_oracle(v, scale) for v in x.tolist()]
    inrange = x.abs() <= 127 * scale
    err = (F.int8_dequantize(q, scale) - x).abs()
    assert bool((err[inrange] <= 0.5 * scale * (1 + 1e-5)).all())


def test_int8_ties_to_even_and_saturates_by_hand():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.49, 127.5, -127.5, -128.5, -200.0, 1e9,
                      float("inf"), float("-inf")])
    assert F.int8_quantize(x, 1.0).tolist() == [0, 2, 2, 0, -2, -2, 126, 127, 127, -128, -128, -128, 127, 127, -128]
    # with scale amax / 127 the amax itself lands on +-127: -128 is reached only past -amax (a clipping scale)
    amax = 3.7
    assert F.int8_quantize(torch.tensor([amax, -amax]), kv_format("int8").scale_from_amax(amax)).tolist() == [127, -127]


def test_int8_multiplies_by_the_reciprocal_as_the_engine():
    """x * fp32(1 / s) and x / s round apart near ties: the reference takes the engine's product (found by search:
    x / s = -59.4999..., x * (1 / s) = -59.5000... -> -60 by half to even)."""
    s, x = 0.15887698531150818, -9.453180313110352
    assert torch.round(torch.tensor([x]) / s).item() == -59.0
    assert F.int8_quantize(torch.tensor([x]), s).item() == -60
    # and on a batch of near-ties: the oracle (product) everywhere, the division rule not
    g = torch.Generator().manual_seed(0)
    xs = (torch.randint(-127, 127, (4096,), generator=g).float() + 0.5) * s
    q = F.int8_quantize(xs, s)
    assert q.tolist() == [_int8_oracle(v, s) for v in xs.tolist()]
    assert not torch.equal(q, torch.round(xs / s).clamp(-128, 127).to(torch.int8))


def test_int8_per_head_scale_broadcast_and_dequant():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 8) * torch.tensor([0.1, 1.0, 10.0]).reshape(1, 3, 1)
    scale = (x.abs().amax(dim=(0, 2)) / 127).reshape(3, 1)
    q = F.int8_quantize(x, scale)
    for h in range(3):
        assert torch.equal(q[:, h], F.int8_quantize(x[:, h], float(scale[h])))
        assert int(q[:, h].abs().max()) == 127  # each head's amax on the last code
    deq = F.int8_dequantize(q, scale, torch.bfloat16)
    assert deq.dtype == torch.bfloat16 and torch.equal(deq, (q.float() * scale).bfloat16())
    assert torch.equal(F.int8_quantize(x.bfloat16(), scale), F.int8_quantize(x.bfloat16().float(), scale))
    assert torch.equal(F.int8_dequantize(F.int8_quantize(torch.zeros(7), 0.5), 0.5), torch.zeros(7))


def test_int8_rejects_nan_bad_scales_and_other_codes():
    with pytest.raises(KVConvertError, match="NaN"):
        F.int8_quantize(torch.tensor([1.0, float("nan")]), 1.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(KVConvertError, match="int8 scale"):
            F.int8_quantize(torch.ones(4), bad)
    with pytest.raises(KVConvertError, match="torch.int8"):
        F.int8_dequantize(torch.zeros(4, dtype=torch.uint8), 1.0)


def test_int8_fake_quant_is_the_reference():
    """kvconvert.quant.fake_quant's int8 (calibration, the transformers engine) is quantize-dequantize of the
    reference, per tensor and per head ([heads] scales on [batch, heads, tokens, dim])."""
    from kvconvert.quant.fake_quant import fake_quant

    torch.manual_seed(1)
    x = torch.randn(2, 3, 5, 8)
    for scale in (torch.tensor(0.01), torch.tensor([0.004, 0.02, 0.01])):
        s = scale.reshape(-1, 1, 1) if scale.dim() else scale
        expected = F.int8_dequantize(F.int8_quantize(x, s), s)
        assert torch.equal(fake_quant(x, "int8", scale), expected)
