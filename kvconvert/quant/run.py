"""One `kvconvert calibrate` job: validate everything first, then calibrate, then write.

Every user error (unknown kv-dtype, impossible format, existing output, no recognised attention,
too little calibration data) is raised as KVConvertError before the model is loaded; a failure
later (non-finite activations, bad scales) is raised before anything is written.
"""

from __future__ import annotations

import datetime as _dt
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvconvert import __version__
from kvconvert.device import resolve_device
from kvconvert.errors import CheckpointError, KVConvertError
from kvconvert.kvformat import kv_pair
from kvconvert.kvmath import KVShape
from kvconvert.quant.calibrate import (
    CalibrationResult,
    CalibrationSettings,
    calibrate_model,
    calibrate_streamed,
)
from kvconvert.quant.export import resolve_format, write_checkpoint
from kvconvert.quant.memory import release_heap
from kvconvert.quant.options import CalibrateOptions


@dataclass
class CalibrateJob:
    """One `kvconvert calibrate` run: what to calibrate (options: kvconvert.quant.options.CalibrateOptions,
    the recipe block and the CLI's flags) and where to write it."""

    src: str
    options: CalibrateOptions = field(default_factory=CalibrateOptions)
    out: str | Path | None = None
    in_place: bool = False
    overwrite: bool = False
    threads: int | None = None

    def __post_init__(self):
        o = self.options
        self.settings = CalibrationSettings(**o.model_dump())
        self.formats = resolve_format(o.format, o.kv_dtype, o.granularity)
        if (self.out is None) == (not self.in_place):
            raise KVConvertError("give exactly one of --out DIR or --in-place")
        if self.threads is not None and self.threads < 1:
            raise KVConvertError("--threads must be >= 1")


def run_calibrate(job: CalibrateJob, echo=print) -> dict:
    """Run the job; returns {"path", "formats", "tokens", "time_s", "report"}."""
    from kvconvert.checkpoint import (
        CheckpointReader, check_checkpoint, check_output_path, estimate_checkpoint_bytes, load_tokenizer,
    )
    from kvconvert.data import calibration_windows, data_hash
    from kvconvert.progress import counted
    from kvconvert.quant.capture import load_hf_model
    from kvconvert.quant.layout import detect_kv_layout
    from kvconvert.quant.stream import stream_unsupported
    from kvconvert.sources import resolve_source

    if job.threads:
        torch.set_num_threads(job.threads)
    device = resolve_device(job.options.device)  # a missing GPU fails before any work
    t_start = time.perf_counter()
    src = resolve_source(job.src)
    out = Path(src if job.in_place else job.out).absolute()
    if not job.in_place:
        check_output_path(out, job.overwrite, needed_bytes=estimate_checkpoint_bytes(src))
    else:
        check_in_place(job.src, out)
    unshaped = keep_heal_basis(job, src)
    if unshaped:
        echo(f"  {unshaped}")
    reader = CheckpointReader(src)
    check_checkpoint(reader)  # config features, missing tensors (e.g. declared biases), NaN/inf
    layout = detect_kv_layout(reader.config, reader.keys())
    job.settings.check_layout(layout)
    whole_model = stream_unsupported(reader.config, layout)
    check_memory(job, reader, layout, whole_model)
    tokenizer = load_tokenizer(src)
    windows = calibration_windows(tokenizer, job.options.calib_data, job.options.calib_tokens, job.options.window_len)
    echo(f"calibrating {layout.kind} ({layout.num_layers} layers) on {windows.numel()} tokens of "
         f"{job.options.calib_data!r}: {job.options.kv_dtype}, observer {job.options.observer}, {job.options.granularity}")
    if whole_model is None:
        result = calibrate_streamed(reader, layout, windows, job.settings,
                                    progress=counted("  calibrated layer", echo), device=device)
    else:
        echo(f"  {whole_model}: not in the layer-streamed blocks; loading the whole model in fp32 on the CPU")
        result = calibrate_model(load_hf_model(src), layout, windows, job.settings,
                                 progress=counted("  observed windows", echo))
    if unshaped:
        result.plan.description["latent_shaping"] = {"auto": unshaped}
    result.stats["path"] = "whole-model (fp32)" if whole_model else "layer-streamed"
    result.stats["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    elapsed = time.perf_counter() - t_start
    report = build_report(job, src, layout, result, windows, data_hash(windows), elapsed)
    reader.close()
    release_heap()  # the layer loop's freed blocks, before the export allocates its own
    # --in-place: out is src; CheckpointWriter builds the new folder beside it and swaps it in
    written, source = ({**report, "in_place": True}, out) if job.in_place else (report, src)
    write_checkpoint(source, out, layout, result.scales, result.plan, job.formats, written,
                     job.overwrite or job.in_place)
    return {"path": out, "formats": job.formats, "tokens": int(windows.numel()), "time_s": elapsed, "report": report}


def check_in_place(name: str, src: Path) -> None:
    """--in-place rewrites only a user's own writable folder: never a built-in model's import or the hub
    cache (kvconvert.resources.managed_folder), which every later command reads as that model."""
    from kvconvert.resources import managed_folder

    managed = managed_folder(src)
    if managed:
        raise CheckpointError(f"--in-place on {name!r} ({src}) would rewrite {managed}: later commands naming "
                              f"{name!r} would measure against the calibrated weights. Write a calibrated copy "
                              "with --out DIR instead")
    if not os.access(src, os.W_OK):
        raise CheckpointError(f"{src}: not writable; use --out DIR instead of --in-place")


def keep_heal_basis(job: CalibrateJob, src: Path) -> str | None:
    """Turn the default latent shaping off for a checkpoint healed through a rounded cache: that heal
    learned the rounding in the Hadamard basis (kvconvert.heal.quant_aware), which shaping would replace.
    Returns why (None when nothing changed)."""
    from kvconvert.checkpoint import healed_cache_format

    healed = healed_cache_format(src)
    if not (job.settings.shaping_auto and healed):
        return None
    job.settings = job.settings.model_copy(update={"latent_shaping": 0.0})
    return (f"latent shaping off: the source was healed through a rounded {healed} cache in the Hadamard basis "
            "(heal_distill.kv_dtype), which calibrate keeps")


def check_memory(job: CalibrateJob, reader, layout: KVShape, whole_model: str | None) -> None:
    """Refuse up front when the estimated peak memory exceeds what the machine has available."""
    from kvconvert.memory import available_memory  # one reading of the machine (cgroup-aware)
    from kvconvert.quant.memory import calibration_memory, check_calibration_memory, whole_model_memory

    if whole_model is None:
        rotating = job.settings.rotation_enabled
        est = calibration_memory(reader.config, job.options.calib_tokens, job.options.window_len, job.options.batch_size,
                                 job.options.search_tokens, key_phase=rotating and job.settings.key_phase_enabled(layout),
                                 value_rotation=rotating and job.settings.value_rotation_enabled)
    else:  # the fp32 model plus a batch's logits and activations
        est = whole_model_memory(reader.config, reader.num_parameters(), job.options.calib_tokens,
                                 job.options.window_len, job.options.batch_size)
    check_calibration_memory(est, available_memory(), job.options.window_len, job.options.batch_size)


def build_report(job: CalibrateJob, src: Path, layout: KVShape, result: CalibrationResult,
                 windows: torch.Tensor, hash_: str, elapsed: float) -> dict:
    """calibration_report.json: settings, data, per-layer amax/scales, rotation, timings."""
    tokens = int(windows.numel())
    layers = []
    for i, obs in enumerate(result.observers):
        entry = {"layer": i}
        for kind, o in obs.items():
            entry[f"{kind}_amax"] = o.amax_head.tolist()
        if result.scales is not None:
            entry["k_scale"] = result.scales.k[i].tolist()
            if not layout.is_mla:
                entry["v_scale"] = result.scales.v[i].tolist()
        if result.stats.get("search"):
            entry["search"] = result.stats["search"][i]
        layers.append(entry)
    wall, cpu = result.stats["wall_s"], result.stats["cpu_s"]
    return {
        "producer": f"kvconvert {__version__}",
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "source": str(src),
        "layout": layout.kind,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.cached_heads,
        "head_dim": layout.row_dim,
        "kv_dtype": job.options.kv_dtype,
        "observer": job.options.observer,
        "percentile": job.options.percentile if job.options.observer == "percentile" else None,
        "granularity": job.options.granularity,
        "formats": list(job.formats),
        "scale_convention": kv_pair(job.options.kv_dtype).k.scale_rule,  # "-" for llama.cpp's types and their pairs
        "mla_row": ("one scale for the cached [latent | k_rope] row, written as k_scale and v_scale"
                    if layout.is_mla else None),
        "calibration": {"data": job.options.calib_data, "tokens": tokens, "windows": int(windows.shape[0]),
                        "window_len": int(windows.shape[1]), "data_hash": hash_,
                        "search_windows": result.stats.get("search_windows", 0)},
        "rotation": result.plan.description or None,
        "path": result.stats.get("path"),
        "peak_rss_mb_before_export": result.stats.get("peak_rss_mb"),
        "time_s": {"total": elapsed, **wall},
        "cpu_s": cpu,
        # the observation pass scales with tokens; rotation planning and the mse search are fixed costs
        "seconds_per_million_tokens": wall["observe"] / tokens * 1e6,
        "cpu_seconds_per_million_tokens": cpu["observe"] / tokens * 1e6,
        "threads": torch.get_num_threads(),
        "layers": layers,
    }
