"""Paged MLA decode: Triton kernel (interpreter) vs the float64 PyTorch reference, per cache mode.

Tolerances: fp32 dot operands (the CPU default) accumulate in fp32 against a float64 reference on
the same dequantized cache: atol = rtol = 1e-4 on the output and the LSE. fp16 dot operands round
q, the latent and the probabilities to 11 bits: atol = rtol = 5e-3. bf16 operands (8 bits, GPU only):
||out - ref|| / ||ref|| < 1e-2 and LSE within 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.kernels._launch import e4m3_query_rows
from kvconvert.kernels.attention import paged_mla_decode
from kvconvert.kernels.cache_layout import MLACacheLayer, mla_fp8_tile
from kvconvert.kernels.mla_decode import paged_mla_decode_reference

from kernel_cases import (
    DEVICE, FP8_WGMMA_LSE_ATOL, LOW_PRECISION_DOTS, assert_decode_close, assert_fp8_dot_close,
    assert_low_precision_close, make_paging,
)

MODES = ("none", "fp8", "fp8_tile", "nvfp4", "nvfp4_fp8rope")
# a test mode that is a layout mode with another RoPE dtype: nvfp4 latent + e4m3 k_rope (kvformat nvfp4_fp8rope)
LAYOUT_MODES = {"nvfp4_fp8rope": ("nvfp4", torch.float8_e4m3fn)}
# (heads, kv_lora_rank, rope_dim): SmolLM2 conversions (9 heads, rope 32) and one small DeepSeek case
SHAPES = [(9, 64, 32), (9, 96, 32), (9, 160, 32), (16, 512, 64)]


def build_case(mode, heads, rank, rope_dim, block_size, seq_lens, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    tables, lens, slots, num_blocks = make_paging(seq_lens, block_size, seed=seed)
    latent = torch.randn(len(slots), rank).to(DEVICE)
    rope = torch.randn(len(slots), rope_dim).to(DEVICE)
    amax = float(torch.cat([latent, rope], -1).abs().max())
    layout_mode, cache_dtype = LAYOUT_MODES.get(mode, (mode, dtype))
    cache = MLACacheLayer.allocate(
        layout_mode, num_blocks, block_size, rank, rope_dim, dtype=cache_dtype, device=DEVICE, kv_scale=amax / 448
    )
    cache.append(latent, rope, slots, backend="torch")
    q_nope = torch.randn(len(seq_lens), heads, rank).to(DEVICE, dtype)
    q_rope = torch.randn(len(seq_lens), heads, rope_dim).to(DEVICE, dtype)
    scale = 1 / math.sqrt(rank + rope_dim) * 2
    return cache, q_nope, q_rope, tables, lens, scale, (latent, rope)


# every mode x shape at block size 16; block size 64 on the smallest and the DeepSeek shape
CASES = [
    (mode, *shape, block_size)
    for mode in MODES
    for shape in SHAPES
    for block_size in (16, 64)
    if block_size == 16 or shape in (SHAPES[0], SHAPES[-1])
]


@pytest.mark.parametrize("mode,heads,rank,rope_dim,block_size", CASES)
def test_mla_decode_matches_reference(mode, heads, rank, rope_dim, block_size):
    seq_lens = [37, 1, 0, 90] if rank < 512 else [70, 9]
    cache, qn, qr, *args, _ = build_case(mode, heads, rank, rope_dim, block_size, seq_lens)
    out, lse = paged_mla_decode(qn, qr, cache, *args, dot="fp32")
    assert_decode_close((out, lse), paged_mla_decode_reference(qn, qr, cache, *args), 1e-4)
    if 0 in seq_lens:
        assert torch.equal(out[seq_lens.index(0)], torch.zeros(heads, rank, device=DEVICE))


# (case, kernel options, tolerance): split counts (1, 2, 5 ranges), fp16 caches with fp16 dot
# operands, and the launch configs the GPU benchmark tunes over
OPTION_CASES = [
    *((("fp8_tile", 9, 64, 32, 16, [100, 3, 47]), {"num_splits": n, "dot": "fp32"}, 1e-4) for n in (1, 2, 5)),
    *(((mode, 9, 96, 32, 16, [40, 17], 0, torch.float16), {"dot": "fp16"}, 5e-3) for mode in ("none", "nvfp4")),
    *((("nvfp4", 9, 160, 32, 16, [70, 5]), {"dot": "fp32", "block_n": n, "block_h": h}, 1e-4)
      for n, h in ((32, 16), (64, 32))),
    # the second, transposed latent load for QK^T in every mode: ragged tiles, a padded rank (96: fp8_tile
    # scales by gather), the DeepSeek shape with splits
    *(((mode, 9, rank, 32, 16, [70, 1, 0, 33]), {"dot": "fp32", "latent_loads": 2, "block_n": n}, 1e-4)
      for mode in MODES for rank, n in ((64, 16), (96, 64))),
    *(((mode, 16, 512, 64, 64, [300, 9]), {"dot": "fp32", "latent_loads": 2, "block_n": 32, "num_splits": 3}, 1e-4)
      for mode in ("fp8", "nvfp4")),
    (("nvfp4", 9, 96, 32, 16, [40, 17], 0, torch.float16), {"dot": "fp16", "latent_loads": 2}, 5e-3),
]


@pytest.mark.parametrize("case,options,tol", OPTION_CASES)
def test_mla_kernel_options_match_reference(case, options, tol):
    cache, qn, qr, *args, _ = build_case(*case)
    assert_decode_close(paged_mla_decode(qn, qr, cache, *args, **options),
                        paged_mla_decode_reference(qn, qr, cache, *args), tol)


@pytest.mark.parametrize("dot", LOW_PRECISION_DOTS)
@pytest.mark.parametrize("mode", MODES)
def test_mla_low_precision_dot_operands_every_mode(mode, dot):
    """Both dots (QK^T and P@V) with rounded operands, on the DeepSeek shape: every dequant path
    must feed the matrix units correctly (the P@V operand is the latent tile itself)."""
    cache, qn, qr, *args, _ = build_case(mode, 16, 512, 64, 64, [300, 1, 129], seed=3)
    assert_low_precision_close(paged_mla_decode(qn, qr, cache, *args, dot=dot),
                               paged_mla_decode_reference(qn, qr, cache, *args))


@pytest.mark.parametrize("latent_loads", [1, 2])
@pytest.mark.parametrize("block_h,block_n", [(16, 32), (64, 64)])
def test_mla_fp8_dot_operands(block_h, block_n, latent_loads):
    """dot='fp8' on the DeepSeek shape: the fp8 cache's bytes, e4m3 queries (one scale per head, for the
    latent and the RoPE part each) and e4m3 probabilities feed the dots. block_h 64 is the tile that
    lowers to Hopper's fp8 wgmma."""
    cache, qn, qr, *args, _ = build_case("fp8", 16, 512, 64, 64, [300, 1, 129, 0], seed=3)
    out = paged_mla_decode(qn, qr, cache, *args, dot="fp8", block_h=block_h, block_n=block_n, latent_loads=latent_loads)
    wgmma = DEVICE.type == "cuda" and block_h == 64
    assert_fp8_dot_close(out, paged_mla_decode_reference(e4m3_query_rows(qn), e4m3_query_rows(qr), cache, *args),
                         lse_atol=FP8_WGMMA_LSE_ATOL if wgmma else 1e-4)
    assert torch.equal(out[0][3], torch.zeros_like(out[0][3]))


@pytest.mark.parametrize("mode", ["fp8", "nvfp4", "nvfp4_fp8rope"])
@pytest.mark.parametrize("heads,rank,rope_dim,block_size,block_n,splits", [
    (*shape, 16, 16, None) for shape in SHAPES] + [(9, 64, 32, 64, 32, 3), (16, 512, 64, 64, 64, 2)])
def test_mla_word_planes_match_reference(mode, heads, rank, rope_dim, block_size, block_n, splits):
    """word_planes: the fp8 latent read as 16-bit words on even/odd byte planes, the NVFP4 latent on
    four nibble planes (values times 2^-14, the global scale times 2^14), give the reference's attention to fp32
    accumulation (the same values summed in another order), for every shape (padded ranks: 96, 160), ragged and
    empty sequences, split ranges and tile sizes."""
    seq_lens = [37, 1, 0, 90] if rank < 512 else [130, 9]
    cache, qn, qr, *args, _ = build_case(mode, heads, rank, rope_dim, block_size, seq_lens)
    out = paged_mla_decode(qn, qr, cache, *args, dot="fp32", word_planes=True, block_n=block_n, num_splits=splits)
    assert_decode_close(out, paged_mla_decode_reference(qn, qr, cache, *args), 1e-4)
    if 0 in seq_lens:
        assert torch.equal(out[0][seq_lens.index(0)], torch.zeros(heads, rank, device=DEVICE))


@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
@pytest.mark.parametrize("dot", LOW_PRECISION_DOTS)
def test_mla_word_planes_low_precision_dots(mode, dot):
    """Both dots with rounded operands on the DeepSeek shape (the cached values are exact in fp16 and bf16, the
    NVFP4 ones down to 2^-24 as fp16 subnormals: only q and the probabilities round), as the tuned benchmark
    config runs them (block_n 32, 4 warps)."""
    cache, qn, qr, *args, _ = build_case(mode, 16, 512, 64, 64, [300, 1, 129], seed=3)
    assert_low_precision_close(paged_mla_decode(qn, qr, cache, *args, dot=dot, word_planes=True, block_n=32),
                               paged_mla_decode_reference(qn, qr, cache, *args))


def test_mla_word_planes_rejects_what_it_cannot_read():
    cache, qn, qr, *args, _ = build_case("fp8_tile", 9, 64, 32, 16, [5])
    with pytest.raises(KVConvertError, match="word_planes reads an fp8"):
        paged_mla_decode(qn, qr, cache, *args, word_planes=True)
    cache, qn, qr, *args, _ = build_case("fp8", 9, 64, 32, 16, [5])
    for options in ({"latent_loads": 2}, {"dot": "fp8", "block_n": 32}):
        with pytest.raises(KVConvertError, match="latent_loads=1 and bf16/fp16/fp32"):
            paged_mla_decode(qn, qr, cache, *args, word_planes=True, **options)
    cache, qn, qr, *args, _ = build_case("nvfp4", 9, 32, 32, 16, [5])
    with pytest.raises(KVConvertError, match="kv_lora_rank > 32"):
        paged_mla_decode(qn, qr, cache, *args, word_planes=True)


@pytest.mark.parametrize("mode", ["none", "fp8_tile", "nvfp4", "nvfp4_fp8rope"])
def test_mla_fp8_dot_needs_an_fp8_cache(mode):
    cache, qn, qr, *args, _ = build_case(mode, 9, 64, 32, 16, [5])
    with pytest.raises(KVConvertError, match="needs an fp8 cache"):
        paged_mla_decode(qn, qr, cache, *args, dot="fp8", block_n=32)


def test_mla_reference_equals_dense_attention_over_logical_tokens():
    """The paged reference equals plain attention over each sequence's tokens (paging is transparent)."""
    seq_lens = [23, 40]
    cache, qn, qr, tables, lens, scale, (latent, rope) = build_case("none", 9, 64, 32, 16, seq_lens)
    out, lse = paged_mla_decode_reference(qn, qr, cache, tables, lens, scale)
    start = 0
    for b, n in enumerate(seq_lens):
        c, kr = latent[start : start + n].double(), rope[start : start + n].double()
        scores = scale * (qn[b].double() @ c.T + qr[b].double() @ kr.T)
        torch.testing.assert_close(out[b], (torch.softmax(scores, -1) @ c).float(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1).float(), atol=1e-6, rtol=1e-6)
        start += n


@pytest.mark.parametrize("mode,max_rel", [("fp8", 0.05), ("fp8_tile", 0.05), ("nvfp4", 0.2), ("nvfp4_fp8rope", 0.2)])
def test_mla_quantized_output_close_to_unquantized(mode, max_rel):
    """The dequantization is applied (kernel output tracks the fp32 cache within the format's error)."""
    seq_lens = [64, 30]
    exact_cache, qn, qr, tables, lens, scale, _ = build_case("none", 9, 64, 32, 16, seq_lens, seed=3)
    quant_cache, *_ = build_case(mode, 9, 64, 32, 16, seq_lens, seed=3)
    exact, _ = paged_mla_decode(qn, qr, exact_cache, tables, lens, scale)
    approx, _ = paged_mla_decode(qn, qr, quant_cache, tables, lens, scale)
    rel = float((approx - exact).norm() / exact.norm())
    assert 0 < rel < max_rel


def test_mla_fp8_tile_sizes():
    assert [mla_fp8_tile(r) for r in (512, 64, 96, 160, 48)] == [128, 64, 96, 80, 48]
    with pytest.raises(KVConvertError, match="multiple of 16"):
        mla_fp8_tile(40)


def test_mla_launcher_rejects_bad_inputs(monkeypatch):
    cache, qn, qr, tables, lens, scale, _ = build_case("fp8", 9, 64, 32, 16, [5])
    with pytest.raises(KVConvertError, match="kv_lora_rank"):
        paged_mla_decode(qn[..., :32], qr, cache, tables, lens, scale)
    with pytest.raises(KVConvertError, match="block_tables must be int32"):
        paged_mla_decode(qn, qr, cache, tables.long(), lens, scale)
    with pytest.raises(KVConvertError, match="seq_lens must be int32"):
        paged_mla_decode(qn, qr, cache, tables, lens.long(), scale)
    with pytest.raises(KVConvertError, match="backend"):
        paged_mla_decode(qn, qr, cache, tables, lens, scale, backend="cuda")
    with pytest.raises(KVConvertError, match="dot precision"):
        paged_mla_decode(qn, qr, cache, tables, lens, scale, dot="tf64")
    with pytest.raises(KVConvertError, match="block_n >= 32"):
        paged_mla_decode(qn, qr, cache, tables, lens, scale, dot="fp8")
    with pytest.raises(KVConvertError, match="softmax_scale"):
        paged_mla_decode(qn, qr, cache, tables, lens, float("nan"))
    with pytest.raises(KVConvertError, match="latent_loads must be 1 or 2"):
        paged_mla_decode(qn, qr, cache, tables, lens, scale, latent_loads=3)
    if DEVICE.type == "cpu":
        with pytest.raises(KVConvertError, match="seq_lens must lie"):
            paged_mla_decode(qn, qr, cache, tables, lens + tables.shape[1] * 16, scale)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(KVConvertError, match="GPU tensors"):
            paged_mla_decode(qn, qr, cache, tables, lens, scale)


def test_mla_cache_layout_validation():
    with pytest.raises(KVConvertError, match="mode"):
        MLACacheLayer.allocate("int4", 2, 16, 64, 32)
    with pytest.raises(KVConvertError, match="kv_scale"):
        MLACacheLayer.allocate("fp8", 2, 16, 64, 32)
    with pytest.raises(KVConvertError, match="positive"):
        MLACacheLayer.allocate("nvfp4", 2, 16, 64, 32, kv_scale=0.0)
    good = MLACacheLayer.allocate("nvfp4", 2, 16, 64, 32, kv_scale=0.1)
    with pytest.raises(KVConvertError, match="dtype"):
        MLACacheLayer("nvfp4", 64, 32, good.data.to(torch.int8), good.rope, good.scales, good.tensor_scale)
    with pytest.raises(KVConvertError, match="shape"):
        MLACacheLayer("nvfp4", 64, 32, good.data, good.rope[..., :16], good.scales, good.tensor_scale)
