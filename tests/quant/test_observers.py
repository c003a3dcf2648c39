"""Observers against hand-computed statistics, and accumulation across batches."""

import math

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.quant.observers import KVObserver, StreamingHistogram


def rank_percentile(x: torch.Tensor, p: float) -> float:
    """The sample whose rank first reaches p% of the count (what a histogram CDF finds)."""
    ordered = x.reshape(-1).sort().values
    return float(ordered[math.ceil(p / 100 * ordered.numel()) - 1])


def within_one_bin_above(got: float, exact: float, width: float) -> bool:
    """A histogram reports the upper edge of the bin holding the exact value."""
    return -1e-6 <= got - exact <= width + 1e-6


def test_histogram_range_doubling_is_exact_merge():
    """Small values first, then a value 100x larger: same counts as one pass at the final range."""
    torch.manual_seed(1)
    small, large = torch.rand(5000) * 0.5, torch.tensor([60.0, 3.0])
    streamed = StreamingHistogram(bins=256)
    streamed.add(small)
    streamed.add(large)
    one_pass = StreamingHistogram(bins=256)
    one_pass.add(torch.cat((large, small)))
    assert streamed.range == one_pass.range == 64.0
    assert torch.equal(streamed.counts, one_pass.counts)
    assert streamed.total == 5002 and streamed.max == 60.0


def test_observer_amax_per_head_and_tensor_by_hand():
    obs = KVObserver(num_heads=2, dim=4, bins=256)
    x = torch.zeros(1, 2, 3, 4)
    x[0, 0, 1, 2] = -5.0
    x[0, 1, 2, 3] = 2.5
    x[0, 1, 0, 0] = -1.0
    obs.observe(x)
    assert obs.amax_head.tolist() == [5.0, 2.5]
    assert obs.amax_tensor == 5.0
    assert obs.amax_channel[1].tolist() == [1.0, 0.0, 0.0, 2.5]
    assert obs.tokens == 3
    assert obs.statistic("amax", "head").tolist() == [5.0, 2.5]
    assert obs.statistic("amax", "tensor").item() == 5.0


def test_statistics_accumulate_over_all_batches():
    """A larger first batch's statistics survive a smaller second batch (not last-batch-only)."""
    torch.manual_seed(2)
    first = torch.randn(2, 3, 64, 16) * 4
    first[1, 2, 5, 7] = 40.0  # the max lives in batch 1
    second = torch.randn(1, 3, 8, 16)
    obs = KVObserver(num_heads=3, dim=16, bins=2048)
    obs.observe(first)
    obs.observe(second)
    both = torch.cat((first.transpose(0, 1).reshape(3, -1), second.transpose(0, 1).reshape(3, -1)), 1).abs()
    assert obs.tokens == 2 * 64 + 8
    assert torch.equal(obs.amax_head, both.amax(1).double())
    assert obs.amax_tensor == 40.0
    for p in (50.0, 99.0, 99.9):  # the histograms' percentiles, per tensor and per head
        got = obs.statistic("percentile", "tensor", p).item()
        assert within_one_bin_above(got, rank_percentile(both, p), obs.tensor_hist.bin_width)
        for h in range(3):
            got = obs.statistic("percentile", "head", p)[h].item()
            assert within_one_bin_above(got, rank_percentile(both[h], p), obs.head_hists[h].bin_width)
    assert obs.statistic("percentile", "tensor", 100.0).item() == 40.0  # capped at the max seen


def test_observer_errors():
    obs = KVObserver(num_heads=2, dim=4)
    with pytest.raises(KVConvertError, match="no calibration tokens"):
        obs.statistic("amax", "tensor")
    with pytest.raises(KVConvertError, match="expects"):
        obs.observe(torch.zeros(1, 3, 2, 4))
    obs.observe(torch.ones(1, 2, 2, 4))
    with pytest.raises(KVConvertError, match="unknown observer"):
        obs.statistic("minmax", "tensor")


def test_an_observer_without_histograms_keeps_the_same_amax_and_refuses_percentile():
    """amax and mse read only the running amax: their observers skip the histograms (most of an observation's
    time) and give the same statistics; asking such an observer for a percentile is an error, not a wrong value."""
    g = torch.Generator().manual_seed(3)
    full, lean = KVObserver(num_heads=2, dim=4), KVObserver(num_heads=2, dim=4, histograms=False)
    for _ in range(3):
        x = torch.randn(2, 2, 5, 4, generator=g)
        full.observe(x)
        lean.observe(x)
    for granularity in ("tensor", "head"):
        assert torch.equal(lean.statistic("amax", granularity), full.statistic("amax", granularity))
    assert torch.equal(lean.amax_channel, full.amax_channel)
    with pytest.raises(KVConvertError, match="percentile"):
        lean.statistic("percentile", "tensor")
