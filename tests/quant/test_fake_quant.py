"""Fake quantization is bit-exact with kvconvert.number_formats, per tensor and per head; MLA row order."""

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert import number_formats as F
from kvconvert.quant.fake_quant import (
    fake_quant,
    mla_row_from_engine,
    mla_row_to_engine,
    scale_from_amax,
)


@pytest.fixture
def kv():
    torch.manual_seed(0)
    return torch.randn(2, 3, 5, 32) * torch.tensor([1.0, 4.0, 0.25]).view(1, 3, 1, 1)


@pytest.mark.parametrize("kv_dtype, reference", [
    ("fp8", lambda x, s: F.fp8_dequantize(F.fp8_quantize(x, s), s)),
    ("fp8_e5m2", lambda x, s: F.fp8_dequantize(F.fp8_quantize(x, s, torch.float8_e5m2), s)),
    # NVFP4's global scale is the stored fp32 scale / 6 (the engine divides it)
    ("nvfp4", lambda x, s: F.nvfp4_dequantize(*F.nvfp4_quantize(x, s / 6), s / 6)),
])
def test_per_tensor_bit_exact(kv, kv_dtype, reference):
    s = 0.0123
    assert torch.equal(fake_quant(kv, kv_dtype, s), reference(kv, torch.tensor(s, dtype=torch.float32)))


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_per_head_equals_head_by_head(kv, kv_dtype):
    scales = torch.tensor([0.01, 0.03, 0.002])
    got = fake_quant(kv, kv_dtype, scales)
    for h in range(3):
        assert torch.equal(got[:, h], fake_quant(kv[:, h:h + 1], kv_dtype, scales[h])[:, 0])


def test_scale_conventions():  # fp8 / fp8_e5m2 / int8 (amax / dtype max): tests/test_kvformat.py
    assert scale_from_amax(448.0, "nvfp4") == 1.0 == scale_from_amax(127.0, "int8")
    with pytest.raises(KVConvertError, match="unknown kv-dtype"):
        scale_from_amax(1.0, "int4")  # planning only: no calibration


def test_fake_quant_refuses_bad_scales_and_nan(kv):
    with pytest.raises(KVConvertError):
        fake_quant(kv, "fp8", 0.0)
    with pytest.raises(KVConvertError, match="does not match"):
        fake_quant(kv, "fp8", torch.ones(2))
    bad = kv.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(KVConvertError, match="NaN"):
        fake_quant(bad, "nvfp4", 0.1)


@pytest.mark.parametrize("interleave", [True, False])
def test_mla_row_round_trip_and_engine_order(interleave):
    latent = torch.randn(1, 1, 3, 32)
    k_rope = torch.arange(8.0).expand(1, 1, 3, 8)  # HF order for interleave: [x0, x2, x4, x6, x1, x3, x5, x7]
    row = mla_row_to_engine(latent, k_rope, interleave)
    assert torch.equal(row[..., :32], latent)
    expected = [0.0, 4, 1, 5, 2, 6, 3, 7] if interleave else list(range(8))
    assert row[0, 0, 0, 32:].tolist() == expected
    back_latent, back_rope = mla_row_from_engine(row, 32, interleave)
    assert torch.equal(back_latent, latent) and torch.equal(back_rope, k_rope)
