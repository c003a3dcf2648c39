"""MSE-optimal KV scales: search the scales minimizing what the model sees.

The objective (:func:`search_replay_scales`) is the squared error of the attention block's output
(o_proj applied), with the block replayed on recorded calibration inputs (LayerReplay on what
capture.AttentionRecorder recorded, or BlockReplay on the layer-streamed path's records). Keys are
judged through the queries that read them and values through o_proj.

Candidates lie on one absolute grid, ``2^(n / GRID)`` for integer n, so that two machines whose
amax differ in the last bits (fp32 forwards on AVX2 and AVX-512 kernels sum in different orders)
still try the same scales: the search starts at the amax scale rounded up to the grid. For FP8
(floating point) a scale below amax's clips the top and scales up to 2x above it re-align the grid
without clipping; for NVFP4 the scale moves the global scale, which sets the clipping of the largest
blocks and the E4M3 rounding of every block scale. The grid is coarse-to-fine: steps of 2^(1/4)
over the range, then steps of 2^(1/16) around the best. Errors within TIE_RTOL of the smallest are a
tie, won by the largest scale (least clipping): FP8's scales a factor 2 apart round every normal
value alike and differ only in the subnormals, so their errors nearly tie and the plain argmin
flipped between CPUs on such pairs (measured on SmolLM2: one V scale of 30 layers, 2x apart).

The objective is split by KV-head group (query heads h with h // group == g read KV head g): each
group's error is measured through its own o_proj columns, ``|| (x_g - ref_g) @ W_o[:, cols_g]^T ||^2``,
and summed. That ignores the (small, zero-mean) cross terms between groups, so every head's ratio
comes from the same trials as the per-tensor search. The joint result is checked with the full
output error, and a layer whose searched scales do worse than that start there keeps the start.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from kvconvert.kvmath import KVShape
from kvconvert.quant.capture import AttentionRecorder, cache_hook
from kvconvert.kvformat import kv_format
from kvconvert.quant.fake_quant import fake_quant_row

GRID = 16  # candidate scales are 2^(n / GRID), n an integer
COARSE_STEP = 4  # coarse grid: every 4th point (2^(j/4))
FINE = tuple(range(-3, 4))  # fine offsets (grid points) around the coarse best
TIE_RTOL = 1e-4  # errors this close (relative) are a tie: far above the run-to-run noise of fp32 (~1e-6)


def coarse_offsets(kv_dtype: str) -> list[int]:
    """Coarse grid, in grid points from the start: 2^(j/4) from 1/4 (nvfp4, nvfp4_fp8rope) or 1/2 (fp8) up to 2."""
    low = -8 if kv_format(kv_dtype).bits == 4 else -4  # NVFP4's block scales absorb more clipping
    return [j * COARSE_STEP for j in range(low, COARSE_STEP + 1)]


def grid_index(scale: torch.Tensor, up: bool = False) -> torch.Tensor:
    """The nearest grid point n of each scale ([] or [heads]), or with `up` the nearest at or above it, int64;
    Python's libm, not torch's vectorized log2, so the same value gives the same n on every CPU."""
    step = math.ceil if up else round
    return torch.tensor([step(GRID * math.log2(v) - (1e-9 if up else 0.0)) for v in scale.double().reshape(-1).tolist()],
                        dtype=torch.int64).reshape(scale.shape)


def grid_scale(index: torch.Tensor) -> torch.Tensor:
    """float32 2^(n / GRID) of each grid point (Python's pow: the same bits on every CPU)."""
    return torch.tensor([2.0 ** (n / GRID) for n in index.reshape(-1).tolist()],
                        dtype=torch.float32).reshape(index.shape)


def argmin_prefer_last(errors: torch.Tensor) -> int:
    """Index of the smallest error; errors within TIE_RTOL of it tie, and ties go to the later
    (larger-scale, less clipping) candidate."""
    errors = errors.double()
    return int(torch.nonzero(errors <= errors.min() * (1.0 + TIE_RTOL)).max())


class _Replay(ABC):
    """Replays one attention layer on recorded inputs with given per-kind scales, cheaply.

    Subclasses fill ``records`` (each with the cached tensors "k"/"v" in transformers' cache layout,
    which is what cache hooks see: K/V, or the MLA latent and k_rope, plus whatever ``_attend``
    needs) and call ``_setup`` with the o_proj weight. Each trial then only re-quantizes the cached
    tensors (MLA: and re-expands them with kv_b_proj) and re-runs the attention - no projections.

    errors(scales) -> (total, per_group [groups]): squared error of the o_proj output vs the
    unquantized replay; per group through that group's o_proj columns only (an orthogonal factor
    R_g of W_o[:, cols_g], ||d W_g^T|| = ||d R_g^T||, keeps it cheap).
    """

    layout: KVShape
    kv_dtype: str
    records: list[dict]

    @torch.no_grad()
    def _setup(self, o_weight: torch.Tensor) -> None:
        w = o_weight.detach().double()  # [hidden, heads * v_dim]
        self.groups = self.layout.cached_heads
        self.width = w.shape[1] // self.groups
        self.w_full = w.float()
        self.r_groups = [torch.linalg.qr(w[:, g * self.width:(g + 1) * self.width], mode="r").R.float()
                         for g in range(self.groups)]
        self.reference = [self._attend(rec, rec["k"], rec["v"]) for rec in self.records]

    @abstractmethod
    def _attend(self, rec: dict, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attention output before o_proj, flattened to [tokens, heads * v_dim]."""

    def _quantized(self, rec: dict, scales: dict) -> tuple[torch.Tensor, torch.Tensor]:
        # the MLA k_rope as the engine stores it (16-bit or FP8 under NVFP4), as eval.kv_quant judges it
        rope_tail = kv_format(self.kv_dtype).rope_tail(self.layout.is_mla, self.layout.qk_rope_head_dim)

        def row_hook(layer_idx, kind, x):
            s = scales.get(kind)
            return x if s is None else fake_quant_row(x, self.kv_dtype, s, rope_tail)
        return cache_hook(self.layout, row_hook)(0, rec["k"], rec["v"])

    @torch.no_grad()
    def errors(self, scales: dict[str, torch.Tensor | None], full: bool = False) -> tuple[float, torch.Tensor]:
        """(total, per_group); total includes cross-group terms only when full=True (else their sum)."""
        total, per_group = 0.0, torch.zeros(self.groups, dtype=torch.float64)
        for rec, ref in zip(self.records, self.reference):
            diff = self._attend(rec, *self._quantized(rec, scales)) - ref
            for g, r in enumerate(self.r_groups):
                per_group[g] += float((diff[:, g * self.width:(g + 1) * self.width] @ r.T).double().square().sum())
            if full:
                total += float((diff @ self.w_full.T).double().square().sum())
        return (total if full else float(per_group.sum())), per_group

    @torch.no_grad()
    def reference_energy(self) -> float:
        return float(sum((r @ self.w_full.T).double().square().sum() for r in self.reference)) or 1.0


class LayerReplay(_Replay):
    """Replay of a transformers attention module on inputs an AttentionRecorder recorded.

    The layer is run once through the real module, capturing what it caches and the arguments of
    its attention function (queries, mask, scaling); trials re-run only that function.
    """

    @torch.no_grad()
    def __init__(self, recorder: AttentionRecorder, layout: KVShape, layer: int, kv_dtype: str):
        self.layout, self.kv_dtype = layout, kv_dtype
        self.attn = recorder.layers[layer].self_attn
        self.records = self._capture(recorder, layer)
        self._setup(self.attn.o_proj.weight)

    def _capture(self, recorder: AttentionRecorder, layer: int) -> list[dict]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        impl = self.attn.config._attn_implementation
        original = ALL_ATTENTION_FUNCTIONS[impl]
        had_local = impl in ALL_ATTENTION_FUNCTIONS._local_mapping
        records: list[dict] = []

        def cache_capture(layer_idx, key, value):
            records.append({"k": key, "v": value})
            return key, value

        def attention_capture(module, query, key, value, attention_mask, **kwargs):
            records[-1].update(q=query, mask=attention_mask, kwargs=kwargs, fn=original)
            return original(module, query, key, value, attention_mask, **kwargs)

        ALL_ATTENTION_FUNCTIONS[impl] = attention_capture
        try:
            recorder.replay(layer, cache_capture)
        finally:
            if had_local:
                ALL_ATTENTION_FUNCTIONS[impl] = original
            else:
                del ALL_ATTENTION_FUNCTIONS[impl]
        return records

    def _attend(self, rec: dict, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.layout.is_mla:  # the cache holds (latent, k_rope); the module expands them
            key, value = self.attn.expand_kv(key, value)
        out = rec["fn"](self.attn, rec["q"], key, value, rec["mask"], **rec["kwargs"])[0]
        return out.reshape(-1, self.w_full.shape[1])


class BlockReplay(_Replay):
    """Replay of a functional attention block (kvconvert.quant.stream): records are
    {"q", "k", "v"} with k/v in transformers' cache layout; attend(q, k, v) -> [B, T, heads * v_dim]."""

    @torch.no_grad()
    def __init__(self, records: list[dict], attend, o_weight: torch.Tensor, layout: KVShape, kv_dtype: str):
        self.layout, self.kv_dtype = layout, kv_dtype
        self.records, self.attend = records, attend
        self._setup(o_weight)

    def _attend(self, rec: dict, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out = self.attend(rec["q"], key, value)
        return out.reshape(-1, out.shape[-1])


class _Trials:
    """replay.errors, each distinct set of scales replayed once. A trial is a pure function of its scales, and
    the grids repeat some: the fine grid's offset 0 is the coarse best. full=True results (cross-group terms
    too) also give the per-group ones."""

    def __init__(self, replay: _Replay):
        self.replay, self.done, self.done_full = replay, {}, {}

    @staticmethod
    def _key(scales: dict) -> tuple:
        return tuple((k, None if s is None else s.numpy().tobytes()) for k, s in sorted(scales.items()))

    def errors(self, scales: dict, full: bool = False) -> tuple[float, torch.Tensor]:
        key = self._key(scales)
        if full and key not in self.done_full:
            self.done_full[key] = self.replay.errors(scales, full=True)
            self.done[key] = (float(self.done_full[key][1].sum()), self.done_full[key][1])
        if not full and key not in self.done:
            self.done[key] = self.replay.errors(scales)
        return (self.done_full if full else self.done)[key]


def _search_kind(trials: _Trials, current: dict, kind: str, start: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Chosen grid points for `kind` (int64 [] per tensor or [heads]) from `start`; other kinds held at `current`."""
    def pick(candidates: list[torch.Tensor]) -> torch.Tensor:
        results = [trials.errors({**current, kind: grid_scale(n)}) for n in candidates]
        if start.dim() == 1:  # per head
            errs = torch.stack([g for _, g in results])  # [candidates, heads]
            best = [argmin_prefer_last(errs[:, h]) for h in range(errs.shape[1])]
            return torch.stack([candidates[b][h] for h, b in enumerate(best)])
        return candidates[argmin_prefer_last(torch.tensor([t for t, _ in results], dtype=torch.float64))]

    best = pick([start + offset for offset in coarse_offsets(kv_dtype)])
    return pick([best + offset for offset in FINE])


@torch.no_grad()
def search_replay_scales(replay: _Replay, layout: KVShape, kv_dtype: str,
                         amax_scales: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Scales for one layer minimizing the attention-output error on the replayed inputs.

    amax_scales: kind -> float32 [] or [heads]. The search starts from them rounded up to the grid ("amax" below:
    no value clips, and two CPUs whose amax differ in the last bits start alike). Kinds are searched in order (K
    with V at its start, then V with the chosen K). Returns (scales, info): info[kind] = the chosen scales as
    ratios to amax_scales, info["grid"][kind] their grid points n (scale = 2^(n / GRID)), and the relative
    output error with the start and with the chosen scales. Where the chosen scales do worse than the start on
    the full output error (cross-group terms included), the layer keeps the start (info["fallback"]).
    """
    energy = replay.reference_energy()
    start_index = {k: grid_index(s, up=True) for k, s in amax_scales.items()}
    start = {k: grid_scale(n) for k, n in start_index.items()}
    trials = _Trials(replay)
    before, _ = trials.errors(start, full=True)
    current = dict(start)
    info, grid = {}, {}
    for kind in layout.cached_names:
        chosen = _search_kind(trials, current, kind, start_index[kind], kv_dtype)
        current[kind], grid[kind] = grid_scale(chosen), chosen.tolist()
    after, _ = trials.errors(current, full=True)
    if after > before:  # cross-head terms made the per-head choice worse on the replay: keep the start
        current, after = start, before
        grid = {kind: n.tolist() for kind, n in start_index.items()}
        info["fallback"] = "amax"
    for kind in layout.cached_names:
        info[kind] = (current[kind].double() / amax_scales[kind].double()).tolist()
    info["grid"] = grid  # the chosen scales are 2^(n / GRID): n per kind, the same on every CPU
    info["rel_error_amax"] = before / energy
    info["rel_error_search"] = after / energy
    return current, info
