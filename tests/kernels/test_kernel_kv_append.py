"""KV append: bit-exact scatter of quantized rows (Triton vs reference vs a Python loop)."""

from __future__ import annotations

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import kv_format
from kvconvert.kernels.append import kv_append_reference, kv_append_triton
from kvconvert.kernels.cache_layout import GQACacheLayer, MLACacheLayer

from kernel_cases import DEVICE, make_paging


def _random_rows(shape, dtype, gen):
    """Random bit patterns of any dtype (NaN-free for floats: bytes go through a float view)."""
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    return torch.randn(shape, generator=gen).clamp(-400, 400).to(dtype)


# (row shape, dtype): fp8 latent+rope, packed nvfp4, e4m3 block scales, fp32 tile scales,
# bf16 rope, GQA fp8 [heads, D], and odd widths that force the int16 / uint8 paths
ROW_KINDS = [
    ((96,), torch.float8_e4m3fn),
    ((40,), torch.uint8),
    ((5,), torch.float8_e4m3fn),
    ((3,), torch.float32),
    ((32,), torch.bfloat16),
    ((3, 64), torch.float8_e4m3fn),
    ((3, 4), torch.float8_e4m3fn),
    ((7,), torch.float16),
    ((3,), torch.uint8),
]


@pytest.mark.parametrize("row_shape,dtype", ROW_KINDS)
def test_kv_append_bit_exact(row_shape, dtype):
    gen = torch.Generator().manual_seed(0)
    tables, lens, slots, num_blocks = make_paging([5, 20, 3], 16)
    slots[4] = -1  # skipped token
    rows = _random_rows((len(slots), *row_shape), dtype, gen).to(DEVICE)
    before = _random_rows((num_blocks, 16, *row_shape), dtype, gen).to(DEVICE)
    got, ref = before.clone(), before.clone()
    kv_append_triton(got, rows, slots)
    kv_append_reference(ref, rows, slots)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    got, before, rows, slots = got.cpu(), before.cpu(), rows.cpu(), slots.cpu()
    loop = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            loop[s // 16, s % 16] = rows[t]
    assert torch.equal(got.view(torch.uint8), loop.view(torch.uint8))
    # slots not written (including the skipped token's would-be slot) keep their old bytes
    written = torch.zeros(num_blocks * 16, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat_got, flat_before = got.view(num_blocks * 16, -1), before.view(num_blocks * 16, -1)
    assert torch.equal(flat_got[~written].view(torch.uint8), flat_before[~written].view(torch.uint8))


@pytest.mark.parametrize("mode", ["fp8", "fp8_tile", "nvfp4"])
def test_mla_layer_append_triton_equals_torch(mode):
    torch.manual_seed(3)
    _, _, slots, num_blocks = make_paging([9, 17], 16)
    latent, rope = torch.randn(len(slots), 160).to(DEVICE), torch.randn(len(slots), 32).to(DEVICE)
    caches = [MLACacheLayer.allocate(mode, num_blocks, 16, 160, 32, device=DEVICE, kv_scale=0.02) for _ in range(2)]
    caches[0].append(latent, rope, slots, backend="triton")
    caches[1].append(latent, rope, slots, backend="torch")
    for name in ("data", "rope", "scales"):
        a, b = getattr(caches[0], name), getattr(caches[1], name)
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    latent_back, rope_back = caches[0].dequantize()
    flat = latent_back.reshape(-1, 160)[slots]
    assert float((flat - latent).norm() / latent.norm()) < (0.15 if mode == "nvfp4" else 0.05)


def test_gqa_layer_append_nvfp4_per_head_roundtrip():
    torch.manual_seed(4)
    _, _, slots, num_blocks = make_paging([12], 16)
    k, v = torch.randn(12, 3, 64).to(DEVICE), (torch.randn(12, 3, 64) * 5).to(DEVICE)
    k_scale, v_scale = k.abs().amax((0, 2)) / 448, v.abs().amax((0, 2)) / 448
    cache = GQACacheLayer.allocate("nvfp4", num_blocks, 16, 3, 64, device=DEVICE, k_scale=k_scale, v_scale=v_scale)
    cache.append(k, v, slots)
    k_back, v_back = (t.reshape(-1, 3, 64)[slots] for t in cache.dequantize())
    assert float((k_back - k).norm() / k.norm()) < 0.15 and float((v_back - v).norm() / v.norm()) < 0.15


def test_kv_append_rejects_bad_input():
    cache = torch.zeros(4, 16, 8, dtype=torch.uint8, device=DEVICE)
    rows = torch.zeros(2, 8, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(KVConvertError, match="slot >="):
        kv_append_triton(cache, rows, torch.tensor([0, 64], device=DEVICE))
    with pytest.raises(KVConvertError, match="other than -1"):
        kv_append_triton(cache, rows, torch.tensor([0, -2], device=DEVICE))
    with pytest.raises(KVConvertError, match="int64"):
        kv_append_triton(cache, rows, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    with pytest.raises(KVConvertError, match="do not match"):
        kv_append_triton(cache, rows.float(), torch.tensor([0, 1], device=DEVICE))


@pytest.mark.parametrize("mode,fmt", [("none", "bf16"), ("fp8", "fp8"), ("nvfp4", "nvfp4")])
def test_layout_bytes_per_token_equal_the_registry(mode, fmt):
    """The kernels' layouts store per token what kvconvert.kvformat counts (and the runtime allocates)."""
    fmt = kv_format(fmt)
    mla = MLACacheLayer.allocate(mode, 1, 16, 64, 32, device=DEVICE, kv_scale=0.1)
    gqa = GQACacheLayer.allocate(mode, 1, 16, 3, 64, device=DEVICE, k_scale=0.1, v_scale=0.1)
    assert mla.bytes_per_token == fmt.vector_bytes(64 + 32, 32)
    assert gqa.bytes_per_token == 2 * 3 * fmt.vector_bytes(64, 0)
