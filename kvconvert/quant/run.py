"""One `kvconvert calibrate` job: validate everything first, then calibrate, then write.

Every user error (unknown kv-dtype, impossible format, existing output, no recognised attention,
too little calibration data) is raised as KVConvertError before the model is loaded; a failure
later (non-finite activations, bad scales) is raised before anything is written.
"""

from __future__ import annotations

import datetime as _dt
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvconvert import __version__
from kvconvert.errors import KVConvertError
from kvconvert.quant.calibrate import (
    CalibrationResult,
    CalibrationSettings,
    calibrate_model,
    calibrate_streamed,
)
from kvconvert.quant.export import (
    check_writable_in_place,
    resolve_format,
    rewrite_in_place,
    write_checkpoint,
)
from kvconvert.quant.fake_quant import check_kv_dtype
from kvconvert.quant.layout import KVLayout


@dataclass
class CalibrateJob:
    """Arguments of `kvconvert calibrate` (validated in __post_init__; see the CLI help)."""

    src: str
    kv_dtype: str
    observer: str = "mse"
    granularity: str = "tensor"
    percentile: float = 99.99
    calib_data: str = "builtin"
    calib_tokens: int = 16384
    window_len: int = 512
    fmt: str = "auto"
    rotate: bool | None = None
    key_phase: bool = True
    value_rotation: bool | None = None
    rotation_block: int = 0
    key_strength: float = 0.0
    out: str | Path | None = None
    in_place: bool = False
    overwrite: bool = False
    batch_size: int = 4
    threads: int | None = None
    search_tokens: int = 1024

    def __post_init__(self):
        check_kv_dtype(self.kv_dtype)
        self.settings = CalibrationSettings(self.kv_dtype, observer=self.observer, granularity=self.granularity,
                                            percentile=self.percentile, rotate=self.rotate, key_phase=self.key_phase,
                                            value_rotation=self.value_rotation, rotation_block=self.rotation_block,
                                            key_strength=self.key_strength,
                                            batch_size=self.batch_size, search_tokens=self.search_tokens)
        self.formats = resolve_format(self.fmt, self.kv_dtype, self.granularity)
        if (self.out is None) == (not self.in_place):
            raise KVConvertError("give exactly one of --out DIR or --in-place")
        if self.calib_tokens <= 0 or self.window_len <= 1:
            raise KVConvertError("--calib-tokens must be > 0 and --window-len > 1")
        if self.calib_tokens < self.window_len:  # as `kvconvert mla`: never round up silently
            raise KVConvertError(f"--calib-tokens {self.calib_tokens} is less than one window ({self.window_len}); "
                                 f"use --calib-tokens {self.window_len} or more, or a smaller --window-len")
        if self.batch_size < 1:
            raise KVConvertError("--batch-size must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise KVConvertError("--threads must be >= 1")


def run_calibrate(job: CalibrateJob, echo=print) -> dict:
    """Run the job; returns {"path", "formats", "tokens", "time_s", "report"}."""
    from transformers import AutoTokenizer

    from kvconvert.checkpoint import CheckpointReader, check_checkpoint, check_output_path, estimate_checkpoint_bytes
    from kvconvert.data import calibration_windows, data_hash
    from kvconvert.quant.capture import load_model
    from kvconvert.quant.layout import detect_kv_layout
    from kvconvert.quant.stream import stream_unsupported
    from kvconvert.sources import resolve_source

    if job.threads:
        torch.set_num_threads(job.threads)
    t_start = time.perf_counter()
    src = resolve_source(job.src)
    out = Path(src if job.in_place else job.out).absolute()
    if job.in_place:
        check_writable_in_place(out)
    else:
        check_output_path(out, job.overwrite, needed_bytes=estimate_checkpoint_bytes(src))
    reader = CheckpointReader(src)
    check_checkpoint(reader)  # config features, missing tensors (e.g. declared biases), NaN/inf
    layout = detect_kv_layout(reader.config, reader.keys())
    if layout.is_mla and job.granularity == "head":
        raise KVConvertError("MLA caches one [latent | k_rope] row per token (no KV heads): use --granularity tensor")
    whole_model = stream_unsupported(reader.config, layout)
    check_memory(job, reader, layout, whole_model)
    tokenizer = AutoTokenizer.from_pretrained(src)
    windows = calibration_windows(tokenizer, job.calib_data, job.calib_tokens, job.window_len)
    echo(f"calibrating {layout.kind} ({layout.num_layers} layers) on {windows.numel()} tokens of "
         f"{job.calib_data!r}: {job.kv_dtype}, observer {job.observer}, {job.granularity}")
    if whole_model is None:
        result = calibrate_streamed(reader, layout, windows, job.settings,
                                    progress=lambda done, n: echo(f"  calibrated layer {done}/{n}"))
    else:
        echo(f"  {whole_model}: not in the layer-streamed blocks; loading the whole model in fp32")
        result = calibrate_model(load_model(src), layout, windows, job.settings,
                                 progress=lambda done, n: echo(f"  observed {done}/{n} windows"))
    result.stats["path"] = "whole-model (fp32)" if whole_model else "layer-streamed"
    result.stats["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    elapsed = time.perf_counter() - t_start
    report = build_report(job, src, layout, result, windows, data_hash(windows), elapsed)
    if job.in_place:
        rewrite_in_place(out, layout, result.scales, result.plan, job.formats, report)
    else:
        write_checkpoint(src, out, layout, result.scales, result.plan, job.formats, report, job.overwrite)
    return {"path": out, "formats": job.formats, "tokens": int(windows.numel()), "time_s": elapsed, "report": report}


def check_memory(job: CalibrateJob, reader, layout: KVLayout, whole_model: str | None) -> None:
    """Refuse up front when the estimated peak memory exceeds what the machine has available."""
    from kvconvert.quant.memory import (GB, MemoryEstimate, available_memory, calibration_memory,
                                        check_calibration_memory)

    if whole_model is None:
        rotating = job.settings.rotation_enabled
        est = calibration_memory(reader.config, job.calib_tokens, job.window_len, job.batch_size,
                                 job.search_tokens, key_phase=rotating and job.settings.key_phase_enabled(layout),
                                 value_rotation=rotating and job.settings.value_rotation_enabled)
    else:  # the fp32 model (4 bytes per stored parameter) plus a batch's logits and activations
        params = reader.num_parameters()
        vocab = int(reader.config.get("vocab_size") or 0)
        est = MemoryEstimate(fixed=int(0.6 * GB) + 4 * params + 8 * job.batch_size * job.window_len * vocab,
                             per_token=0, tokens=job.calib_tokens)
    check_calibration_memory(est, available_memory(), job.window_len, job.batch_size)


def build_report(job: CalibrateJob, src: Path, layout: KVLayout, result: CalibrationResult,
                 windows: torch.Tensor, hash_: str, elapsed: float) -> dict:
    """calibration_report.json: settings, data, per-layer amax/scales, rotation, timings."""
    tokens = int(windows.numel())
    layers = []
    for i, obs in enumerate(result.observers):
        entry = {"layer": i}
        for kind, o in obs.items():
            entry[f"{kind}_amax"] = o.amax_head.tolist()
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
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "kv_dtype": job.kv_dtype,
        "observer": job.observer,
        "percentile": job.percentile if job.observer == "percentile" else None,
        "granularity": job.granularity,
        "formats": list(job.formats),
        "scale_convention": ("amax / 57344 (fp8 e5m2)" if job.kv_dtype == "fp8_e5m2" else
                             "amax / 448; NVFP4 global scale = scale / 6" if job.kv_dtype == "nvfp4" else "amax / 448"),
        "mla_row": ("one scale for the cached [latent | k_rope] row, written as k_scale and v_scale"
                    if layout.is_mla else None),
        "calibration": {"data": job.calib_data, "tokens": tokens, "windows": int(windows.shape[0]),
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
