"""MSE-optimal KV scales: search scale ratios minimizing what the model sees.

Two objectives:
* :func:`dequant_mse_ratio` - squared dequantization error of the cached tensor itself (pure; used
  in tests and as a reference);
* :func:`search_layer_scales` - squared error of the attention block's output (o_proj applied),
  with the block replayed on recorded calibration inputs (capture.AttentionRecorder). Keys are
  judged through the queries that read them and values through o_proj.

Candidates are ``amax_scale * ratio``. For FP8 (floating point) a ratio below 1 clips the top and
ratios in (1, 2] re-align the grid without clipping; for NVFP4 the ratio moves the global scale,
which sets the clipping of the largest blocks and the E4M3 rounding of every block scale.
The grid is coarse-to-fine: 2^(j/4) over the range, then 2^(k/16) steps around the best.

Per head: the input of o_proj is split by KV-head group (query heads h with h // group == g read
KV head g), and each group's error is measured through its own o_proj columns,
``|| (x_g - ref_g) @ W_o[:, cols_g]^T ||^2``. That ignores the (small) cross terms between groups, so
every head's ratio is chosen from the same replays as the per-tensor search; the joint result is
then checked, and a layer whose searched scales do worse than amax on the replay keeps amax.
"""

from __future__ import annotations

import torch

from kvconvert.quant.capture import AttentionRecorder, cache_hook
from kvconvert.quant.fake_quant import fake_quant
from kvconvert.quant.layout import KVLayout

COARSE_STEP = 4  # coarse grid 2^(j/4)
FINE = tuple(2.0 ** (k / 16) for k in range(-3, 4))  # fine offsets around the coarse best


def coarse_ratios(kv_dtype: str) -> torch.Tensor:
    """Coarse grid (float64): 2^(j/4) from 1/4 (nvfp4) or 1/2 (fp8) up to 2."""
    low = -8 if kv_dtype == "nvfp4" else -4
    return torch.tensor([2.0 ** (j / COARSE_STEP) for j in range(low, COARSE_STEP + 1)], dtype=torch.float64)


def dequant_mse_ratio(x: torch.Tensor, kv_dtype: str, amax_scale: torch.Tensor | float,
                      ratios: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Best ratio for x [b, heads, T, dim] under plain dequantization MSE; returns (ratio, errors [R])."""
    errors = torch.stack([
        (fake_quant(x, kv_dtype, torch.as_tensor(amax_scale) * float(r)).double() - x.double()).square().sum()
        for r in ratios])
    return float(ratios[argmin_prefer_last(errors)]), errors


def argmin_prefer_last(errors: torch.Tensor) -> int:
    """Index of the smallest error; ties go to the later (larger-ratio, less clipping) candidate."""
    return int(torch.nonzero(errors <= errors.min()).max())


class LayerReplay:
    """Replays one attention layer on recorded inputs with given per-kind scales.

    errors(scales) -> (total [], per_group [groups]) squared output errors vs the unquantized replay.
    """

    def __init__(self, recorder: AttentionRecorder, layout: KVLayout, layer: int, kv_dtype: str):
        self.recorder, self.layout, self.layer, self.kv_dtype = recorder, layout, layer, kv_dtype
        attn = recorder.layers[layer].self_attn
        self.o_weight = attn.o_proj.weight.detach().double()  # [hidden, heads * v_dim]
        self.groups = layout.num_kv_heads
        self.reference = self._o_inputs(lambda i, k, v: (k, v))

    def _o_inputs(self, hook) -> list[torch.Tensor]:
        """Inputs of o_proj ([b, T, heads * v_dim]) on every record."""
        attn = self.recorder.layers[self.layer].self_attn
        captured = []
        handle = attn.o_proj.register_forward_pre_hook(lambda m, args: captured.append(args[0].detach()))
        try:
            self.recorder.replay(self.layer, hook)
        finally:
            handle.remove()
        return captured

    def errors(self, scales: dict[str, torch.Tensor | None]) -> tuple[float, torch.Tensor]:
        def row_hook(layer_idx, kind, x):
            s = scales.get(kind)
            return x if s is None else fake_quant(x, self.kv_dtype, s)
        total, per_group = 0.0, torch.zeros(self.groups, dtype=torch.float64)
        width = self.o_weight.shape[1] // self.groups
        for got, ref in zip(self._o_inputs(cache_hook(self.layout, row_hook)), self.reference):
            diff = (got.double() - ref.double()).reshape(-1, self.o_weight.shape[1])
            total += float((diff @ self.o_weight.T).square().sum())
            for g in range(self.groups):
                cols = slice(g * width, (g + 1) * width)
                per_group[g] += (diff[:, cols] @ self.o_weight[:, cols].T).square().sum()
        return total, per_group

    def reference_energy(self) -> float:
        return float(sum((r.double().reshape(-1, self.o_weight.shape[1]) @ self.o_weight.T).square().sum()
                         for r in self.reference)) or 1.0


def _search_kind(replay: LayerReplay, current: dict, kind: str, base: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Chosen ratio for `kind` ([] per tensor or [heads]); other kinds held at `current`."""
    per_head = base.dim() == 1

    def evaluate(ratio: torch.Tensor):
        return replay.errors({**current, kind: (base.double() * ratio).float()})

    def pick(ratios_per_candidate: list[torch.Tensor]) -> torch.Tensor:
        results = [evaluate(r) for r in ratios_per_candidate]
        if per_head:
            errs = torch.stack([g for _, g in results])  # [candidates, heads]
            best = [argmin_prefer_last(errs[:, h]) for h in range(errs.shape[1])]
            return torch.stack([ratios_per_candidate[b][h] for h, b in enumerate(best)])
        return ratios_per_candidate[argmin_prefer_last(torch.tensor([t for t, _ in results]))]

    shape = base.shape
    coarse = [torch.full(shape, float(r), dtype=torch.float64) for r in coarse_ratios(kv_dtype)]
    best = pick(coarse)
    fine = [best * f for f in FINE]
    return pick(fine)


@torch.no_grad()
def search_layer_scales(recorder: AttentionRecorder, layout: KVLayout, layer: int, kv_dtype: str,
                        amax_scales: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Scales for one layer minimizing the attention-output error on the recorded inputs.

    amax_scales: kind -> float32 [] or [heads] (the amax scales, the search's starting point).
    Kinds are searched in order (K with V quantized at its amax scale, then V with the chosen K).
    Returns (scales, info): info[kind] = chosen ratios, and the relative output error with amax
    scales and with the chosen ones.
    """
    replay = LayerReplay(recorder, layout, layer, kv_dtype)
    energy = replay.reference_energy()
    start = {k: s.clone() for k, s in amax_scales.items()}
    before, _ = replay.errors(start)
    current = dict(start)
    info = {}
    for kind in layout.kinds:
        ratio = _search_kind(replay, current, kind, amax_scales[kind], kv_dtype)
        current[kind] = (amax_scales[kind].double() * ratio).float()
        info[kind] = ratio.tolist()
    after, _ = replay.errors(current)
    if after > before:  # cross-head terms made the per-head choice worse on the replay: keep amax
        current, after = start, before
        info = {kind: 1.0 for kind in layout.kinds} | {"fallback": "amax"}
    info["rel_error_amax"] = before / energy
    info["rel_error_search"] = after / energy
    return current, info
