"""Paged GQA decode: Triton kernel (interpreter) vs the float64 PyTorch reference, per cache mode.

Tolerances as for MLA: fp32 dot operands, atol = rtol = 1e-4 (output and LSE); fp16 operands 5e-3;
bf16 operands (GPU only) ||out - ref|| / ||ref|| < 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.kernels._launch import e4m3_query_rows
from kvconvert.kernels.attention import paged_gqa_decode
from kvconvert.kernels.cache_layout import GQACacheLayer
from kvconvert.kernels.gqa_decode import paged_gqa_decode_reference

from kernel_cases import (
    DEVICE, LOW_PRECISION_DOTS, assert_decode_close, assert_fp8_dot_close, assert_low_precision_close, make_paging,
)

# (mode, per-head scales)
MODES = [("none", False), ("fp8", False), ("fp8", True), ("nvfp4", False), ("nvfp4", True)]


def build_case(mode, per_head, q_heads, kv_heads, head_dim, block_size, seq_lens, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    tables, lens, slots, num_blocks = make_paging(seq_lens, block_size, seed=seed)
    # heads of different magnitudes, so per-head scales matter
    head_gain = torch.linspace(0.5, 3.0, kv_heads).reshape(1, kv_heads, 1)
    k = (torch.randn(len(slots), kv_heads, head_dim) * head_gain).to(DEVICE)
    v = (torch.randn(len(slots), kv_heads, head_dim) * head_gain.flip(1)).to(DEVICE)
    if per_head:
        k_scale, v_scale = k.abs().amax(dim=(0, 2)) / 448, v.abs().amax(dim=(0, 2)) / 448
    else:
        k_scale, v_scale = float(k.abs().max()) / 448, float(v.abs().max()) / 448
    cache = GQACacheLayer.allocate(
        mode, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE, k_scale=k_scale, v_scale=v_scale
    )
    cache.append(k, v, slots, backend="torch")
    q = torch.randn(len(seq_lens), q_heads, head_dim).to(DEVICE, dtype)
    return cache, q, tables, lens, head_dim**-0.5


# (q_heads, kv_heads, head_dim): SmolLM2-135M, a group wider than BLOCK_H (20 > 16), and MQA with D=128
SHAPES = [(9, 3, 64), (40, 2, 32), (4, 1, 128)]
CASES = [(m, ph, *shape, bs) for m, ph in MODES for shape in SHAPES for bs in (16, 64) if bs == 16 or shape == SHAPES[0]]


@pytest.mark.parametrize("mode,per_head,q_heads,kv_heads,head_dim,block_size", CASES)
def test_gqa_decode_matches_reference(mode, per_head, q_heads, kv_heads, head_dim, block_size):
    cache, q, *args = build_case(mode, per_head, q_heads, kv_heads, head_dim, block_size, [37, 0, 70])
    out, lse = paged_gqa_decode(q, cache, *args, dot="fp32")
    assert_decode_close((out, lse), paged_gqa_decode_reference(q, cache, *args), 1e-4)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


# (case, kernel options, tolerance): an fp16 cache with fp16 dot operands over 3 ranges, and the
# launch configs the GPU benchmark tunes over
OPTION_CASES = [
    (("none", False, 9, 3, 64, 16, [50, 9], 0, torch.float16), {"dot": "fp16", "num_splits": 3}, 5e-3),
    (("fp8", True, 40, 2, 32, 16, [70, 5]), {"dot": "fp32", "block_n": 32, "block_h": 16}, 1e-4),
    (("fp8", True, 40, 2, 32, 16, [70, 5]), {"dot": "fp32", "block_n": 64, "block_h": 32}, 1e-4),
]


@pytest.mark.parametrize("case,options,tol", OPTION_CASES)
def test_gqa_kernel_options_match_reference(case, options, tol):
    cache, q, *args = build_case(*case)
    assert_decode_close(paged_gqa_decode(q, cache, *args, **options), paged_gqa_decode_reference(q, cache, *args), tol)


@pytest.mark.parametrize("dot", LOW_PRECISION_DOTS)
@pytest.mark.parametrize("mode,per_head", MODES)
def test_gqa_low_precision_dot_operands_every_mode(mode, per_head, dot):
    """Both dots with rounded operands on a Llama-3-like head (D 128, group 4), every cache mode."""
    cache, q, *args = build_case(mode, per_head, 8, 2, 128, 16, [300, 0, 77], seed=4)
    assert_low_precision_close(paged_gqa_decode(q, cache, *args, dot=dot), paged_gqa_decode_reference(q, cache, *args))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("block_h,block_n", [(16, 32), (64, 64)])
def test_gqa_fp8_dot_operands(per_head, block_h, block_n):
    """dot='fp8' on Llama-3-8B's head shape (group 4, D 128): fp8 K and V bytes, e4m3 queries (one scale
    per head) and e4m3 probabilities feed the dots; per-tensor and per-head cache scales."""
    cache, q, *args = build_case("fp8", per_head, 8, 2, 128, 16, [300, 0, 77], seed=4)
    out = paged_gqa_decode(q, cache, *args, dot="fp8", block_h=block_h, block_n=block_n)
    assert_fp8_dot_close(out, paged_gqa_decode_reference(e4m3_query_rows(q), cache, *args))


def test_gqa_reference_equals_dense_attention():
    """Reference vs a dense computation over the logical tokens, query head h reading KV head h // group."""
    torch.manual_seed(5)
    tables, lens, slots, num_blocks = make_paging([21], 16, seed=5)
    k, v = torch.randn(21, 3, 64).to(DEVICE), torch.randn(21, 3, 64).to(DEVICE)
    cache = GQACacheLayer.allocate("none", num_blocks, 16, 3, 64, dtype=torch.float32, device=DEVICE)
    cache.append(k, v, slots, backend="torch")
    q = torch.randn(1, 9, 64).to(DEVICE)
    out, lse = paged_gqa_decode_reference(q, cache, tables, lens, 0.125)
    for h in range(9):
        scores = 0.125 * (k[:, h // 3].double() @ q[0, h].double())
        expected = torch.softmax(scores, 0) @ v[:, h // 3].double()
        torch.testing.assert_close(out[0, h], expected.float(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse[0, h], torch.logsumexp(scores, 0).float(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode,max_rel", [("fp8", 0.05), ("nvfp4", 0.2)])
def test_gqa_per_head_scales_beat_per_tensor(mode, max_rel):
    """Kernel outputs on quantized caches track the exact cache; per-head scales are no worse."""
    args = (9, 3, 64, 16, [64, 40])
    exact_cache, q, tables, lens, scale = build_case("none", False, *args, seed=2)
    exact, _ = paged_gqa_decode(q, exact_cache, tables, lens, scale)
    errors = []
    for per_head in (False, True):
        cache, *_ = build_case(mode, per_head, *args, seed=2)
        approx, _ = paged_gqa_decode(q, cache, tables, lens, scale)
        errors.append(float((approx - exact).norm() / exact.norm()))
    assert 0 < errors[1] <= errors[0] * 1.05 and errors[0] < max_rel


@pytest.mark.parametrize("mode,per_head", [m for m in MODES if m[0] != "none"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,options", [
    (*SHAPES[0], 16, {}), (*SHAPES[2], 16, {"block_n": 64, "num_splits": 3}), (*SHAPES[0], 64, {"block_h": 64})])
def test_gqa_word_planes_match_reference(mode, per_head, q_heads, kv_heads, head_dim, block_size, options):
    """word_planes on GQA: fp8 K/V as 16-bit words on even/odd byte planes, NVFP4 on four nibble planes
    (values times 2^-14, the scales times 2^14): the reference's attention to fp32 accumulation, per-tensor and
    per-head scales, ragged and empty sequences, splits, 64-row head tiles."""
    cache, q, tables, lens, scale = build_case(mode, per_head, q_heads, kv_heads, head_dim, block_size, [37, 1, 0, 90])
    out = paged_gqa_decode(q, cache, tables, lens, scale, dot="fp32", word_planes=True, **options)
    assert_decode_close(out, paged_gqa_decode_reference(q, cache, tables, lens, scale), 1e-4)
    assert torch.equal(out[0][2], torch.zeros_like(out[0][2]))


@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
@pytest.mark.parametrize("dot", LOW_PRECISION_DOTS)
def test_gqa_word_planes_low_precision_dots(mode, dot):
    cache, q, tables, lens, scale = build_case(mode, True, 32, 8, 128, 64, [300, 1, 129], seed=3)
    assert_low_precision_close(paged_gqa_decode(q, cache, tables, lens, scale, dot=dot, word_planes=True, block_n=64),
                               paged_gqa_decode_reference(q, cache, tables, lens, scale))


def test_gqa_launcher_and_layout_validation(monkeypatch):
    cache, q, tables, lens, scale = build_case("fp8", True, 9, 3, 64, 16, [5])
    with pytest.raises(KVConvertError, match="multiple of kv_heads"):
        paged_gqa_decode(q[:, :8], cache, tables, lens, scale)
    with pytest.raises(KVConvertError, match="head_dim"):
        paged_gqa_decode(q[..., :32], cache, tables, lens, scale)
    with pytest.raises(KVConvertError, match="block_h"):
        paged_gqa_decode(q, cache, tables, lens, scale, block_h=8)
    with pytest.raises(KVConvertError, match="latent_loads is an MLA option"):
        paged_gqa_decode(q, cache, tables, lens, scale, latent_loads=2)
    with pytest.raises(KVConvertError, match="bf16/fp16/fp32 dots"):
        paged_gqa_decode(q, cache, tables, lens, scale, word_planes=True, dot="fp8", block_n=32)
    for mode, head_dim, match in (("none", 64, "word_planes reads fp8"), ("nvfp4", 32, "head_dim > 32")):
        other, *other_args = build_case(mode, False, 9, 3, head_dim, 16, [5])
        with pytest.raises(KVConvertError, match=match):
            paged_gqa_decode(other_args[0], other, *other_args[1:], word_planes=True)
    with pytest.raises(KVConvertError, match="k_scale"):
        GQACacheLayer.allocate("fp8", 2, 16, 3, 64, k_scale=torch.ones(2), v_scale=1.0)
    with pytest.raises(KVConvertError, match="unknown GQA cache mode"):  # the mode first, before its scales
        GQACacheLayer.allocate("int4", 2, 16, 3, 64)
    with pytest.raises(KVConvertError, match="needs calibrated"):
        GQACacheLayer.allocate("nvfp4", 2, 16, 3, 64)
    with pytest.raises(KVConvertError, match="multiple of 16"):
        GQACacheLayer.allocate("nvfp4", 2, 16, 3, 72, k_scale=1.0, v_scale=1.0)
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(KVConvertError, match="GPU tensors"):
            paged_gqa_decode(q, cache, tables, lens, scale)
