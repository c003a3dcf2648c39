"""LSE merge: Triton kernel vs PyTorch reference, and split attention merged == full attention."""

from __future__ import annotations

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.kernels.attention import merge_lse
from kvconvert.kernels.merge import merge_lse_reference

from kernel_cases import DEVICE, assert_lse_close


def _attend(q, k, v):
    """q [R, D], k/v [n, D] -> (out [R, D], lse [R]) in float64; n == 0 gives (0, -inf)."""
    if k.shape[0] == 0:
        return torch.zeros(q.shape[0], v.shape[1], dtype=torch.float64), torch.full((q.shape[0],), float("-inf"), dtype=torch.float64)
    scores = q.double() @ k.double().T
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("cuts", [[0, 7, 7, 30, 64], [0, 64], [0, 1, 2, 3, 4, 5, 6, 64]])
def test_merged_splits_equal_full_attention(cuts):
    """Attention over key ranges (one of them empty in the first case), merged, equals attention over all."""
    torch.manual_seed(0)
    q, k, v = torch.randn(20, 96), torch.randn(64, 96) * 0.3, torch.randn(64, 96)
    parts = [_attend(q, k[a:b], v[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    part_out = torch.stack([p[0] for p in parts], 1).float()  # [20, S, 96]
    part_lse = torch.stack([p[1] for p in parts], 1).float()  # [20, S]
    full_out, full_lse = _attend(q, k, v)
    for backend in ("triton", "torch"):
        out, lse = merge_lse(part_out.to(DEVICE), part_lse.to(DEVICE), backend=backend)
        torch.testing.assert_close(out.cpu(), full_out.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.cpu(), full_lse.float(), atol=1e-5, rtol=1e-5)


def test_merge_all_empty_rows_and_leading_dims():
    torch.manual_seed(1)
    part_out = torch.randn(2, 3, 5, 40)
    part_lse = torch.randn(2, 3, 5) * 4
    part_lse[1, 2] = float("-inf")  # a row whose every part is empty
    part_out[1, 2] = 0.0
    part_lse[0, 0, :4] = float("-inf")  # only the last part counts
    part_out, part_lse = part_out.to(DEVICE), part_lse.to(DEVICE)
    out, lse = merge_lse(part_out, part_lse, out_dtype=torch.float16)
    ref_out, ref_lse = merge_lse_reference(part_out, part_lse, out_dtype=torch.float16)
    assert out.shape == (2, 3, 40) and out.dtype == torch.float16 and lse.shape == (2, 3)
    torch.testing.assert_close(out, ref_out, atol=1e-3, rtol=1e-3)
    assert_lse_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1, 2].float().cpu(), torch.zeros(40)) and lse[1, 2] == float("-inf")
    torch.testing.assert_close(out[0, 0].float(), part_out[0, 0, 4], atol=1e-3, rtol=1e-3)


def test_merge_rejects_bad_shapes():
    with pytest.raises(KVConvertError, match="partial_lse"):
        merge_lse(torch.zeros(2, 3, 8, device=DEVICE), torch.zeros(2, 4, device=DEVICE))
    with pytest.raises(KVConvertError, match="fp32"):
        merge_lse(torch.zeros(2, 3, 8, dtype=torch.float16, device=DEVICE), torch.zeros(2, 3, device=DEVICE))
