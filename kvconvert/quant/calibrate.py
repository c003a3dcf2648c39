"""`kvconvert calibrate`: static FP8 / INT8 / NVFP4 KV-cache scales from calibration data.

Pipeline (all on CPU, fp32). `kvconvert calibrate` runs it layer by layer (calibrate_streamed,
stream.py: one decoder layer's weights in memory at a time); calibrate_model runs the same steps on a
whole transformers model (the reference in tests, and the fallback for architectures the functional
blocks do not cover: biases, qk-norm, MoE, sliding windows):
1. detect what the engine caches (layout.py) and refuse checkpoints with no recognised attention;
2. optionally fold rotations into the weights (rotate.py) - planned from a short statistics pass;
3. one pass over ALL calibration windows with a cache hook: streaming observers (observers.py),
   NaN/inf checked per layer; the attention inputs of the first windows are recorded for (4);
4. scales = observer statistic / 448 (amax, percentile; INT8: / 127), or the attention-output MSE search
   (search.py) started from the amax scales; where the engine stores K and V at one scale (INT8), the two are
   tied a power of two apart (fold.tied_candidates), so they fold to one written scale;
5. export (export.py): weights (copied or rotated) + k/v scales in vLLM and/or ModelOpt names,
   config, calibration_report.json and a PNG, written atomically.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import kv_pair
from kvconvert.targets import check_llamacpp_shape
from kvconvert.kvmath import KVShape
from kvconvert.quant.capture import (
    AttentionRecorder, decoder_layers, run_with_hook,
)
from kvconvert.quant.fake_quant import scale_from_amax
from kvconvert.quant.fold import tied_candidates
from kvconvert.quant.latent_shape import (
    LatentMoments, check_linear_norm, norm_is_linear, predicted_noise_ratio, shaping_transform,
)
from kvconvert.quant.observers import KVObserver, layer_observers, observing_hook
from kvconvert.quant.options import CalibrateOptions
from kvconvert.quant.pair_stats import STAT_WINDOWS, PairMomentObserver, PairMoments
from kvconvert.quant.rotate import (
    RotationPlan,
    apply_plan_to_model,
    block_hadamard,
    pair_amax_from_channels,
    pair_balance_scale,
    pair_equalizing_scale,
    pair_noise,
    pair_phase,
)
from kvconvert.quant.scales import KVScales
from kvconvert.quant.search import LayerReplay, argmin_prefer_last, search_replay_scales


class CalibrationSettings(CalibrateOptions):
    """How to calibrate (independent of where the result is written): the options of `kvconvert
    calibrate` (CalibrateOptions: fields, defaults and limits), plus the seed of the value rotation's
    random signs (None: plain Hadamard), which has no flag. CalibrationSettings("fp8", observer="amax").

    rotate: fold exact weight rewrites at all (None = on). What is folded when rotating:
    key_phase: per-RoPE-pair phases of q/k that minimize the scores' rounding noise (rotate.pair_phase),
    for every dtype that quantizes keys (not the MLA k_rope under nvfp4, which stays bf16).
    value_rotation: Hadamard on V / the MLA latent (None = nvfp4 only; FP8's relative rounding does not
    care). rotation_block: its Hadamard block (0 = largest power of two dividing the dim, capped at
    128). key_strength: RoPE-pair amax equalization of the keys (0 = off: measured worse for nvfp4).
    """

    rotation_seed: int | None = 0

    def __init__(self, kv_dtype: str | None = None, /, **fields):
        super().__init__(**(fields if kv_dtype is None else {**fields, "kv_dtype": kv_dtype}))

    def check_layout(self, layout: KVShape) -> None:
        kv_pair(self.kv_dtype).check_cache_kind(layout.is_mla)
        check_llamacpp_shape(self.kv_dtype, layout.is_mla, head_dim=layout.head_dim, rank=layout.kv_lora_rank,
                             rope_dim=layout.qk_rope_head_dim)
        if not self.shaping_auto and self.latent_shaping > 0 and not layout.is_mla:
            raise KVConvertError("--latent-shaping transforms an MLA latent; this checkpoint caches per-head K/V "
                                 "(use the Hadamard of --value-rotation there)")
        if layout.is_mla and self.granularity == "head":
            raise KVConvertError("MLA caches one [latent | k_rope] row per token (no KV heads): "
                                 "use --granularity tensor")
        if kv_pair(self.kv_dtype).k.shared_kv_scale and self.granularity == "head":
            raise KVConvertError(f"{self.kv_dtype}: the engine stores K and V of a layer at one scale (TensorRT-LLM's "
                                 "INT8 cache), per tensor: use --granularity tensor")

    def search_windows(self, window_len: int) -> int:
        """Calibration windows of `window_len` tokens the mse search replays (0: no search)."""
        if self.observer != "mse" or not kv_pair(self.kv_dtype).has_kv_scale:
            return 0
        return max(1, math.ceil(self.search_tokens / window_len))

    def key_phase_enabled(self, layout: KVShape) -> bool:
        """Phases only help where the (rope) keys are quantized: not the MLA k_rope under nvfp4 (bf16), and
        not under an engine that turns the keys by a Hadamard before its block quantizer (llama.cpp)."""
        return self.key_phase_on and not (layout.is_mla and kv_pair(self.kv_dtype).k.mla_rope == "bf16")

    def key_balance_for(self, layout: KVShape) -> float:
        """The key pair balance power for this layout: its default is on only where the engine's rotation spreads
        each key's rounding over the whole head (llama.cpp's per-head K); its MLA row is not rotated."""
        return 0.0 if layout.is_mla and self.key_balance is None else self.key_balance_power

    def needs_pair_moments(self, layout: KVShape) -> bool:
        return self.key_phase_enabled(layout) or self.key_balance_for(layout) > 0


@dataclass
class CalibrationResult:
    scales: KVScales | None  # None for llama.cpp's types: their block scales are set as rows are written
    plan: RotationPlan
    observers: list[dict[str, KVObserver]]
    stats: dict = field(default_factory=dict)  # amax per layer, search info, timings


def observe_kv(model, layout: KVShape, windows: torch.Tensor, batch_size: int,
               recorder: AttentionRecorder | None = None, record_windows: int = 0,
               progress=None, histograms: bool = True) -> list[dict[str, KVObserver]]:
    """One pass over all windows ([N, T]); returns per-layer observers of every cached tensor
    (histograms: kept for the percentile statistic).

    The recorder (if any) records the attention inputs of the first `record_windows` windows.
    """
    observers = [layer_observers(layout, histograms) for _ in range(layout.num_layers)]
    hook = observing_hook(layout, observers.__getitem__)
    record_windows = min(record_windows, windows.shape[0]) if recorder is not None else 0
    done = 0
    for part, recording in ((windows[:record_windows], True), (windows[record_windows:], False)):
        if recorder is not None:
            recorder.active = recording
        for start in range(0, part.shape[0], batch_size):
            batch = part[start:start + batch_size]
            run_with_hook(model, batch, hook, batch_size=batch.shape[0])
            done += batch.shape[0]
            if progress is not None:
                progress(done, windows.shape[0])
    if recorder is not None:
        recorder.active = False
    return observers


def plan_rotation(model, layout: KVShape, settings: CalibrationSettings, windows: torch.Tensor) -> RotationPlan:
    """Hadamard for V / the MLA latent and per-RoPE-pair key factors (phase and, optionally, scale).

    Key statistics come from one pass over (at most 8 of) the calibration windows.
    """
    stat_windows = windows[:STAT_WINDOWS]
    desc: dict = {}
    rot = value_rotation(layout, settings, desc)
    transforms = None
    if shaping_enabled(layout, settings):
        latent_moments = observe_latent_moments(model, layout, stat_windows, settings.batch_size)
        transforms = [layer_shaping(i, m, layout, settings, desc) for i, m in enumerate(latent_moments)]
    phase, strength, balance = settings.key_phase_enabled(layout), settings.key_strength, settings.key_balance_for(layout)
    need_moments = settings.needs_pair_moments(layout)
    moments = observe_pair_moments(model, layout, stat_windows, settings.batch_size) if need_moments else []
    key_obs = observe_kv(model, layout, stat_windows, settings.batch_size, histograms=False) if strength > 0 else []
    factors = None
    if need_moments or strength > 0:
        factors = [_key_factor(layout, m, obs, strength, phase, balance)
                   for m, obs in itertools.zip_longest(moments, key_obs)]
    _describe_key_factors(desc, moments, strength, stat_windows, phase, balance)
    return RotationPlan(layout, rot, factors, desc, transforms)


def shaping_enabled(layout: KVShape, settings: CalibrationSettings) -> bool:
    return layout.is_mla and settings.shaping_power > 0


def layer_shaping(layer: int, moments: LatentMoments, layout: KVShape, settings: CalibrationSettings,
                  desc: dict) -> torch.Tensor | None:
    """One layer's latent transform (kvconvert.quant.latent_shape); its predicted noise ratio and norm range
    go into desc["latent_shaping"]. Where the layer's norm is not linear the fold would not be exact: a
    --latent-shaping given is refused; the default keeps the latent Hadamard there (None where the format
    folds none), and names the layer."""
    info = desc.setdefault("latent_shaping", {"power": settings.shaping_power, "auto": settings.shaping_auto,
                                              "source_tokens": moments.tokens, "predicted_noise_ratio_per_layer": [],
                                              "max_norm_ratio": 0.0})
    info["max_norm_ratio"] = max(info["max_norm_ratio"], moments.max_norm_ratio)
    ratios = info["predicted_noise_ratio_per_layer"]
    if settings.shaping_auto and not norm_is_linear(moments):
        info.setdefault("unshaped_layers", []).append(layer)
        transform, ratio = hadamard(layout, settings, desc), 1.0
    else:
        check_linear_norm(moments, layer)
        transform = shaping_transform(moments.covariance, settings.shaping_power, seed=layer)
        ratio = round(predicted_noise_ratio(moments.covariance, transform), 4)
    ratios.append(ratio)
    info["predicted_noise_ratio_mean"] = round(sum(ratios) / len(ratios), 4)
    return transform


def observe_latent_moments(model, layout: KVShape, windows: torch.Tensor, batch_size: int) -> list[LatentMoments]:
    """Pre-norm latent moments per layer (outputs of kv_a_proj_with_mqa) over all `windows` ([N, T])."""
    rank = layout.kv_lora_rank
    layers = decoder_layers(model)
    moments = [LatentMoments.empty(rank) for _ in layers]

    def hook(i, eps):
        return lambda module, args, out: moments[i].add(out[..., :rank], eps)
    handles = [layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(
        hook(i, layer.self_attn.kv_a_layernorm.variance_epsilon)) for i, layer in enumerate(layers)]
    try:
        run_with_hook(model, windows, lambda layer, key, value: (key, value), batch_size=batch_size)
    finally:
        for h in handles:
            h.remove()
    return moments


def _key_factor(layout: KVShape, moments: PairMoments | None, key_obs: dict[str, KVObserver] | None,
                strength: float, phase: bool = True, balance: float = 0.0) -> torch.Tensor:
    """One layer's key pair factor: the phase (`phase`) and the balancing scale (`balance` > 0) from its pair
    moments, times the equalizing scale from its key observers (each None when off)."""
    factor = None if moments is None or not phase else pair_phase(moments.q_moment, moments.k_moment)
    if moments is not None and balance > 0:
        scale = pair_balance_scale(moments.q_power, moments.k_power, balance)
        factor = scale if factor is None else factor * scale
    if key_obs is not None:
        scale = _key_pair_scale(layout, key_obs, strength)
        factor = scale if factor is None else factor * scale
    return factor


def _describe_key_factors(desc: dict, moments: list[PairMoments], strength: float, windows: torch.Tensor,
                          phase: bool = True, balance: float = 0.0) -> None:
    if moments and phase:
        desc["key_pair_phase"] = _phase_summary(moments, windows)
    if moments and balance > 0:
        desc["key_pair_balance"] = _balance_summary(moments, balance, windows)
    if strength > 0:
        desc["key_pair_scaling"] = {"strength": strength, "source_windows": int(windows.shape[0])}


def value_rotation(layout: KVShape, settings: CalibrationSettings, desc: dict) -> torch.Tensor | None:
    """The Hadamard for V / the MLA latent of every layer (None when off, or when shaping replaces it)."""
    return None if shaping_enabled(layout, settings) else hadamard(layout, settings, desc)


def hadamard(layout: KVShape, settings: CalibrationSettings, desc: dict) -> torch.Tensor | None:
    """The value Hadamard ([dim, dim] float64) where the format takes one, else None; describes it in desc."""
    if not settings.value_rotation_enabled:
        return None
    dim = layout.kv_lora_rank if layout.is_mla else layout.head_dim
    block = settings.rotation_block or min(dim & -dim, 128)
    desc["value_rotation"] = f"hadamard block {block}" + (
        f", random signs seed {settings.rotation_seed}" if settings.rotation_seed is not None else "")
    desc["applies_to"] = "latent (MLA)" if layout.is_mla else "V per KV head"
    return block_hadamard(dim, block, settings.rotation_seed)


def observe_pair_moments(model, layout: KVShape, windows: torch.Tensor, batch_size: int) -> list[PairMoments]:
    """Post-RoPE q/k pair moments per layer over all `windows` ([N, T]) (kvconvert.quant.pair_stats)."""
    observer = PairMomentObserver(model, layout)
    try:
        run_with_hook(model, windows, lambda layer, key, value: (key, value), batch_size=batch_size)
        return observer.result()
    finally:
        observer.remove()


def _phase_summary(moments: list[PairMoments], windows: torch.Tensor) -> dict:
    """What the phases are predicted to do: the rope-key score noise after / before, per layer."""
    ratio = []
    for m in moments:
        f = pair_phase(m.q_moment, m.k_moment)
        before = pair_noise(m.q_moment, m.k_moment, m.q_power, m.k_power).sum()
        after = pair_noise(m.q_moment, m.k_moment, m.q_power, m.k_power, f).sum()
        ratio.append(round(float(after / before), 4) if float(before) > 0 else 1.0)
    return {"source_windows": int(windows.shape[0]), "predicted_noise_ratio_per_layer": ratio,
            "predicted_noise_ratio_mean": round(sum(ratio) / len(ratio), 4)}


def _balance_summary(moments: list[PairMoments], power: float, windows: torch.Tensor) -> dict:
    """What the balancing scales are predicted to do: the score noise of a rotated block quantizer,
    E|q'|^2 E|k'|^2, after / before, per layer (rotate.pair_balance_scale)."""
    ratio = []
    for m in moments:
        s = pair_balance_scale(m.q_power, m.k_power, power)
        before = float(m.q_power.sum() * m.k_power.sum())
        after = float((m.q_power / s ** 2).sum() * (m.k_power * s ** 2).sum())
        ratio.append(round(after / before, 4) if before > 0 else 1.0)
    return {"power": power, "source_windows": int(windows.shape[0]), "predicted_noise_ratio_per_layer": ratio,
            "predicted_noise_ratio_mean": round(sum(ratio) / len(ratio), 4)}


def _key_pair_scale(layout: KVShape, obs: dict[str, KVObserver], strength: float) -> torch.Tensor:
    if not layout.is_mla:
        pair = pair_amax_from_channels(obs["k"].amax_channel, interleave=False)  # [kv_heads, d/2]
        return pair_equalizing_scale(pair, strength)
    # MLA row [latent | k_rope] in engine order: k_rope pairs are adjacent (2i, 2i+1) when interleaved,
    # and (i, i + r/2) otherwise - the same index sets as the weights' RoPE pairs.
    channels = obs["kv"].amax_channel[0]
    latent, rope = channels[:layout.kv_lora_rank], channels[layout.kv_lora_rank:]
    pair = pair_amax_from_channels(rope, interleave=layout.rope_interleave)
    # pull every pair toward the latent's typical channel amax (they share one global scale)
    target = latent[latent > 0].log().mean().exp() if bool((latent > 0).any()) else pair.max()
    alpha = (target / pair.clamp_min(1e-30)).pow(strength).clamp(1 / 16, 16)
    return torch.where(pair > 0, alpha, torch.ones_like(alpha))


def calibrate_model(model, layout: KVShape, windows: torch.Tensor, settings: CalibrationSettings,
                    progress=None) -> CalibrationResult:
    """Calibrate an in-memory fp32 model (rotating its weights in place if enabled)."""
    settings.check_layout(layout)
    clock = _Clock()
    plan = RotationPlan(layout)
    if settings.rotation_enabled:
        plan = plan_rotation(model, layout, settings, windows)
        apply_plan_to_model(model, plan)
    clock.lap("rotation")
    record = settings.search_windows(windows.shape[1])
    recorder = AttentionRecorder(model) if record else None
    try:
        observers = observe_kv(model, layout, windows, settings.batch_size, recorder, record, progress,
                               histograms=settings.observer == "percentile")
        clock.lap("observe")
        per_layer = [_layer_scales(layout, layer, obs, settings, lambda layer=layer: LayerReplay(
            recorder, layout, layer, settings.kv_dtype)) for layer, obs in enumerate(observers)]
        clock.lap("search")
    finally:
        if recorder is not None:
            recorder.remove()
    return _result(layout, settings, per_layer, plan, observers, clock, record)


class _Clock:
    """Wall and process-CPU seconds per phase (CPU time is what a shared machine cannot inflate)."""

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._w, self._c = time.perf_counter(), time.process_time()

    def lap(self, name: str) -> None:
        w, c = time.perf_counter(), time.process_time()
        self.wall[name] = self.wall.get(name, 0.0) + w - self._w  # phases recur per layer when streamed
        self.cpu[name] = self.cpu.get(name, 0.0) + c - self._c
        self._w, self._c = w, c


def _layer_scales(layout, layer, obs, settings, make_replay):
    """(kind -> scale, search info or None) of one layer from its observers (and a replay, for mse)."""
    amax = {kind: o.statistic(settings.observer, settings.granularity, settings.percentile)
            for kind, o in obs.items()}
    for kind, a in amax.items():
        if not bool(torch.isfinite(a).all()) or bool((a <= 0).any()):
            raise KVConvertError(
                f"layer {layer}: the cached {kind} is all zeros or non-finite on the calibration data "
                f"(amax {a.tolist()}); cannot derive a scale - use more or different --calib-data")
    if not kv_pair(settings.kv_dtype).has_kv_scale:  # llama.cpp's types: nothing to calibrate but the weights
        return {}, None
    scale = {kind: scale_from_amax(a, settings.kv_dtype).float() for kind, a in amax.items()}
    tie = kv_pair(settings.kv_dtype).k.shared_kv_scale and not layout.is_mla  # MLA: one row scale already
    if settings.observer != "mse":
        return (tie_kv_scales(scale)[0] if tie else scale), None
    replay = make_replay()
    scale, info = search_replay_scales(replay, layout, settings.kv_dtype, scale)
    return tie_kv_scales(scale, info, replay) if tie else (scale, info)


def tie_kv_scales(scale: dict, info: dict | None = None, replay=None) -> tuple[dict, dict | None]:
    """K and V scales a power of two apart (fold.tied_candidates), which fold to one written scale: the one an
    engine storing K and V at max(k_scale, v_scale) applies to both (TensorRT-LLM's INT8). With the search's
    replay the pair with the smallest attention-output error wins (near-ties: the larger scales); without one
    (amax, percentile) the pair that raises a scale least, clipping nothing the observer kept. info gets
    "tied": each scale's ratio to its untied one and, with a replay, the tied pair's relative output error."""
    k, v = scale["k"], scale["v"]
    candidates = tied_candidates(k, v)
    if replay is None:
        kept = [c for c in candidates if float(c[0]) >= float(k) and float(c[1]) >= float(v)]
        best = min(kept, key=lambda c: max(float(c[0] / k), float(c[1] / v)))
        return {"k": best[0], "v": best[1]}, info
    errors = torch.tensor([replay.errors({"k": ck, "v": cv}, full=True)[0] for ck, cv in candidates],
                          dtype=torch.float64)
    i = argmin_prefer_last(errors)
    best = {"k": candidates[i][0], "v": candidates[i][1]}
    info["tied"] = {"k": float(best["k"] / k), "v": float(best["v"] / v),
                    "rel_error": float(errors[i]) / replay.reference_energy()}
    return best, info


def _result(layout, settings, per_layer: list[tuple[dict, dict | None]], plan, observers, clock: _Clock,
            record: int) -> CalibrationResult:
    """The result from each layer's (kind -> scale, search info or None) (_layer_scales)."""
    scales = None
    if kv_pair(settings.kv_dtype).has_kv_scale:
        ks = [s["kv"] if layout.is_mla else s["k"] for s, _ in per_layer]
        vs = [s["kv"] if layout.is_mla else s["v"] for s, _ in per_layer]
        scales = KVScales(settings.kv_dtype, settings.granularity, layout.kind, ks, vs)
    infos = [info for _, info in per_layer if info is not None]
    stats = {"wall_s": clock.wall, "cpu_s": clock.cpu, "search": infos, "search_windows": record}
    return CalibrationResult(scales, plan, observers, stats)


def calibrate_streamed(reader, layout: KVShape, windows: torch.Tensor, settings: CalibrationSettings,
                       progress=None, device="cpu") -> CalibrationResult:
    """Calibrate a checkpoint layer by layer (kvconvert.quant.stream), never building the model;
    the forward runs on `device` (see kvconvert.quant.stream).

    Same statistics, rotation plan and scales as calibrate_model on the whole fp32 model (to fp32
    rounding), in the memory of one layer plus the calibration hidden states.
    """
    from kvconvert.quant.memory import release_heap
    from kvconvert.quant.stream import LayerStream, apply_rotation

    settings.check_layout(layout)
    clock = _Clock()
    stream = LayerStream(reader, layout, windows, settings.batch_size, device)
    desc: dict = {}
    rot = value_rotation(layout, settings, desc) if settings.rotation_enabled else None
    phase = settings.rotation_enabled and settings.key_phase_enabled(layout)
    balance = settings.key_balance_for(layout) if settings.rotation_enabled else 0.0
    need_moments = phase or balance > 0
    strength = settings.key_strength if settings.rotation_enabled else 0.0
    factors, moments = ([] if need_moments or strength > 0 else None), []
    transforms = [] if shaping_enabled(layout, settings) else None
    record = settings.search_windows(windows.shape[1])
    observers, per_layer = [], []
    clock.lap("load")
    for i in range(layout.num_layers):
        attn, rest = stream.read_layer(i)
        clock.lap("load")
        if factors is not None:  # key factors from this layer's (unrotated) statistics, then folded
            m, key_obs = stream.statistics(i, attn, rest, need_moments, strength > 0)
            factors.append(_key_factor(layout, m, key_obs, strength, phase, balance))
            moments += [m] if need_moments else []
        if transforms is not None:
            transforms.append(layer_shaping(i, stream.latent_moments(i, attn, rest), layout, settings, desc))
        layer_plan = RotationPlan(layout, rot, factors, latent_transform=transforms)
        if not layer_plan.is_identity:
            attn = apply_rotation(layer_plan, i, attn, layout.num_heads)
        clock.lap("rotation")
        obs, records = stream.advance(i, attn, rest, record, histograms=settings.observer == "percentile")
        del rest
        clock.lap("observe")
        per_layer.append(_layer_scales(layout, i, obs, settings,
                                       lambda: stream.replay(attn, records, settings.kv_dtype)))
        clock.lap("search")
        observers.append(obs)
        del attn, records  # freed by reference counts (no cycles): a young collection and the trim suffice
        release_heap(generation=1)
        if progress is not None:
            progress(i + 1, layout.num_layers)
    _describe_key_factors(desc, moments, strength, windows[:STAT_WINDOWS], phase, balance)
    return _result(layout, settings, per_layer, RotationPlan(layout, rot, factors, desc, transforms), observers, clock,
                   record)
