"""Streaming statistics of cached K/V activations, accumulated over ALL calibration batches.

Every observer keeps running state: nothing is recomputed from the last batch only (llm-compressor
and others have shipped scales from the last batch, docs/formats.md, "KV-cache number formats and scales"). A small second batch cannot lower an
amax or a percentile seen in the first.

* amax: running max of |x| per head (and per channel, which rotation planning uses).
* percentile: an exact-merge streaming histogram of |x| (see :class:`StreamingHistogram`).
* mse: scale search on replayed attention (kvconvert.quant.search); it starts from these stats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvmath import KVShape
from kvconvert.quant.capture import CacheHook, cache_hook, check_finite
from kvconvert.quant.options import OBSERVERS


class StreamingHistogram:
    """Histogram of non-negative values on ``[0, range]`` with ``bins`` equal bins.

    The range is a power of two. When a value larger than the range arrives the range doubles and
    adjacent bin pairs merge - exact, because the new bin edges are every other old edge - so the
    histogram always equals the one a single pass over all data with the final range would build
    (up to values sitting exactly on a merged edge, which torch.histc puts in the upper bin).
    """

    def __init__(self, bins: int = 4096):
        if bins < 2 or bins & (bins - 1):
            raise ValueError("bins must be a power of two >= 2")
        self.bins = bins
        self.counts = torch.zeros(bins, dtype=torch.float64)
        self.range: float | None = None
        self.max = 0.0
        self.total = 0

    def add(self, values: torch.Tensor) -> None:
        """Add a batch of non-negative values (any shape)."""
        v = values.detach().reshape(-1).float()
        if v.numel() == 0:
            return
        vmax = float(v.max())
        if self.range is None:
            self.range = 2.0 ** math.ceil(math.log2(vmax)) if vmax > 0 else 2.0 ** -126
        while vmax > self.range:
            self._double_range()
        self.counts += torch.histc(v, bins=self.bins, min=0.0, max=self.range).double()
        self.max = max(self.max, vmax)
        self.total += v.numel()

    def _double_range(self) -> None:
        merged = self.counts.view(self.bins // 2, 2).sum(dim=1)
        self.counts = torch.cat((merged, torch.zeros(self.bins // 2, dtype=torch.float64)))
        self.range *= 2.0

    @property
    def bin_width(self) -> float:
        return (self.range or 0.0) / self.bins

    def percentile(self, p: float) -> float:
        """Upper edge of the bin holding the p-th percentile (0 < p <= 100), capped at the max seen."""
        if self.total == 0:
            raise KVConvertError("percentile of an empty histogram: no calibration data was observed")
        if not 0.0 < p <= 100.0:
            raise KVConvertError(f"percentile must be in (0, 100], got {p}")
        target = p / 100.0 * self.total
        cumulative = torch.cumsum(self.counts, dim=0)
        index = int(torch.searchsorted(cumulative, torch.tensor([target], dtype=torch.float64))[0])
        index = min(index, self.bins - 1)
        return min((index + 1) * self.bin_width, self.max)


@dataclass
class KVObserver:
    """Statistics of one cached tensor (a layer's K, V, or MLA row) over all calibration tokens.

    ``observe(x)`` takes x ``[batch, heads, tokens, dim]`` (transformers' cache layout).
    histograms: keep the |x| histograms the percentile statistic reads (amax and mse read only the
    running amax; the histograms were about two thirds of an observation's time).
    """

    num_heads: int
    dim: int
    bins: int = 4096
    histograms: bool = True
    amax_head: torch.Tensor = field(init=False)  # float64 [heads]
    amax_channel: torch.Tensor = field(init=False)  # float64 [heads, dim]
    tokens: int = field(init=False, default=0)

    def __post_init__(self):
        self.amax_head = torch.zeros(self.num_heads, dtype=torch.float64)
        self.amax_channel = torch.zeros(self.num_heads, self.dim, dtype=torch.float64)
        self.head_hists = [StreamingHistogram(self.bins) for _ in range(self.num_heads)] if self.histograms else []
        self.tensor_hist = StreamingHistogram(self.bins) if self.histograms else None

    def observe(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.num_heads or x.shape[-1] != self.dim:
            raise KVConvertError(
                f"observer expects [batch, {self.num_heads}, tokens, {self.dim}], got {tuple(x.shape)}")
        a = x.detach().float().abs().transpose(0, 1).reshape(self.num_heads, -1, self.dim)  # [H, N, D]
        self.amax_channel = torch.maximum(self.amax_channel, a.amax(dim=1).double())
        self.amax_head = self.amax_channel.amax(dim=1)
        for h, hist in enumerate(self.head_hists):
            hist.add(a[h])
        if self.tensor_hist is not None:
            self.tensor_hist.add(a)
        self.tokens += a.shape[1]

    @property
    def amax_tensor(self) -> float:
        return float(self.amax_head.max())

    def statistic(self, observer: str, granularity: str, percentile: float = 99.99) -> torch.Tensor:
        """The clipping magnitude (an "amax") chosen by the observer: float64 [] or [heads].

        amax -> max |x|; percentile -> the `percentile`-th percentile of |x| (never above amax).
        "mse" starts from amax here and is refined by kvconvert.quant.search.
        """
        if self.tokens == 0:
            raise KVConvertError("no calibration tokens reached this layer's KV cache")
        if observer in ("amax", "mse"):
            return self.amax_head.clone() if granularity == "head" else torch.tensor(self.amax_tensor, dtype=torch.float64)
        if observer == "percentile":
            if not self.histograms:
                raise KVConvertError("this observer kept no histograms (KVObserver(histograms=False)): the "
                                     "percentile statistic needs them")
            if granularity == "head":
                return torch.tensor([h.percentile(percentile) for h in self.head_hists], dtype=torch.float64)
            return torch.tensor(self.tensor_hist.percentile(percentile), dtype=torch.float64)
        raise KVConvertError(f"unknown observer {observer!r}: use one of {', '.join(OBSERVERS)}")


def layer_observers(layout: KVShape, histograms: bool = True) -> dict[str, KVObserver]:
    """A fresh observer for each tensor one layer caches (histograms: for the percentile statistic)."""
    return {kind: KVObserver(layout.cached_heads, layout.row_dim, histograms=histograms)
            for kind in layout.cached_names}


def observing_hook(layout: KVShape, observers_of) -> CacheHook:
    """Cache hook feeding observers_of(layer)[kind] with every cached tensor (on the host), after
    refusing NaN/inf; the tensors pass unchanged."""
    def row_hook(layer_idx, kind, x):
        check_finite(layer_idx, kind, x)
        observers_of(layer_idx)[kind].observe(x.cpu())
        return x
    return cache_hook(layout, row_hook)
