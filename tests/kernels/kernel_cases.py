"""Shared builders for the kernel tests: random paging, cache filling, comparisons.

The tests run on CPU in Triton's interpreter. On a GPU machine they also run compiled:
``TRITON_INTERPRET=0 KVCONVERT_TEST_DEVICE=cuda python -m pytest tests/kernels`` (the decode tests
then keep fp32 dot operands, so the same tolerances apply).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed: the kernel tests run in its interpreter")

DEVICE = torch.device(os.environ.get("KVCONVERT_TEST_DEVICE", "cpu"))


def make_paging(seq_lens: list[int], block_size: int, extra_blocks: int = 3, seed: int = 0):
    """Random non-overlapping block tables for ``seq_lens`` plus the slot of every token.

    Returns (block_tables int32 [B, max_blocks], seq_lens int32 [B], slots int64 [T] in
    sequence-major logical order, num_blocks). Unused table entries point at block 0.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(1, max(need))
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots, used = [], 0
    for b, (n, k) in enumerate(zip(seq_lens, need)):
        tables[b, :k] = perm[used : used + k].int()
        used += k
        slots += [int(tables[b, t // block_size]) * block_size + t % block_size for t in range(n)]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return tables.to(DEVICE), lens.to(DEVICE), torch.tensor(slots, dtype=torch.int64).to(DEVICE), num_blocks


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> None:
    """LSEs equal within tolerance; -inf (empty sequence) must match exactly."""
    empty = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), empty)
    torch.testing.assert_close(lse[~empty], ref[~empty], atol=atol, rtol=rtol)


def assert_decode_close(result, reference, tol: float) -> None:
    """A decode kernel's (out, lse) against its reference's: out in q's dtype, out and LSE within
    atol = rtol = tol."""
    (out, lse), (ref_out, ref_lse) = result, reference
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    assert_lse_close(lse, ref_lse, atol=tol, rtol=tol)


# bf16 dot operands are wrong in Triton's interpreter (it has no bf16 matrix unit): CPU runs test
# fp16 only; compiled GPU runs test both (a bf16-only layout bug was found on an H100 this way).
LOW_PRECISION_DOTS = [
    "fp16",
    pytest.param("bf16", marks=pytest.mark.skipif(DEVICE.type == "cpu", reason="bf16 dots need a GPU (wrong in the interpreter)")),
]


def assert_low_precision_close(result, reference) -> None:
    """Rounded (bf16 / fp16) dot operands: ||out - ref|| / ||ref|| < 1e-2 (float64), LSE within 1e-2."""
    (out, lse), (ref_out, ref_lse) = result, reference
    assert float((out.double() - ref_out.double()).norm() / ref_out.double().norm()) < 1e-2
    assert_lse_close(lse, ref_lse, atol=1e-2, rtol=1e-2)


# Hopper's fp8 wgmma (block_h 64 on a GPU) accumulates in fewer bits than fp32 (about 14 significant
# bits, DeepSeek-V3 report 3.3.2): on an H100 the MLA test's LSE was off by up to 2.0e-3 (1e-4 with
# block_h 16, and in the interpreter). Its tolerance is 1.5x that measurement.
FP8_WGMMA_LSE_ATOL = 3e-3


def assert_fp8_dot_close(result, reference_on_e4m3_queries, lse_atol: float = 1e-4) -> None:
    """dot='fp8' against the float64 reference given the same e4m3-rounded queries: the scores are then
    the reference's up to fp32 accumulation (LSE within 1e-4; ``FP8_WGMMA_LSE_ATOL`` where the dot is
    Hopper's fp8 wgmma); the output also carries the e4m3 rounding of the probabilities (up to 2^-4
    each, relative to the running max): ||out - ref|| / ||ref|| < 3e-2."""
    (out, lse), (ref_out, ref_lse) = result, reference_on_e4m3_queries
    assert_lse_close(lse, ref_lse, atol=lse_atol, rtol=1e-4 if lse_atol <= 1e-4 else 0.0)
    assert float((out.double() - ref_out.double()).norm() / ref_out.double().norm()) < 3e-2
