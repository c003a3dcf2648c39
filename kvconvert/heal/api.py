"""`heal_stages(student, teacher, stages, out)`: layer-wise reconstruction then distillation, written as
a stock DeepSeek-V3 checkpoint (CheckpointWriter, atomic). `stages` holds the two stages' options
(heal.options.HealStages: a validated kvconvert.recipe.Recipe is one); reading a recipe file or
preset and `--device` are the recipe's: kvconvert.recipe.heal resolves them and calls this.

Order of work, so that every user error surfaces before any training:
  1. something to heal; output path checked
  2. student/teacher pair checked (compat.check_pair: configs, shared weights, tokenizers)
  3. all training data tokenized (too little data -> error)
  4. heal_layerwise (if any) -> intermediate checkpoint in the state area (or `out` if last)
  5. heal_distill (if any) -> `out`
The state area (`.{out}.heal-state` beside `out`) holds resumable progress; a rerun with the same
inputs continues from it, and it is removed once `out` is complete.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvconvert.checkpoint import (
    CheckpointReader, CheckpointWriter, check_checkpoint, check_output_path, estimate_checkpoint_bytes, load_tokenizer,
    read_manifest,
)
from kvconvert.data import data_hash, load_text, token_windows
from kvconvert.device import resolve_device
from kvconvert.errors import KVConvertError
from kvconvert.eval.runner import checkpoint_fingerprint
from kvconvert.heal import compat
from kvconvert.heal.options import HEAL_BLOCKS, DistillOptions, HealStages, LayerwiseOptions
from kvconvert.heal.teacher_data import fingerprint
from kvconvert.sources import resolve_source

LAYERWISE_VAL_WINDOWS = 1  # held-out calibration windows, measured per layer (not fitted)


def state_dir_for(out: Path) -> Path:
    out = Path(out).absolute()
    return out.parent / f".{out.name}.heal-state"


@dataclass
class HealData:
    layerwise: torch.Tensor | None = None  # [N, window] token ids
    distill: torch.Tensor | None = None  # [N, seq_len]
    info: dict = field(default_factory=dict)


def prepare_data(tokenizer, stages: HealStages, teacher: Path | None = None, progress: bool = False,
                 device: str = "cpu") -> HealData:
    """Tokenize every stage's data up front; too little text raises before any training.

    `data: teacher` in a stage: text sampled from the teacher (kvconvert.heal.teacher_data), enough
    for the larger of the two stages (they share it), generated once and cached."""
    data = HealData()

    @functools.cache  # the two stages may read the same source: load (or generate) it once
    def text(source: str) -> str:
        if source != TEACHER_DATA:
            return load_text(source)
        if teacher is None:
            raise KVConvertError("data: teacher needs the teacher model (kvconvert heal --teacher)")
        from kvconvert.heal.teacher_data import sample_teacher_text

        return sample_teacher_text(teacher, teacher_tokens_needed(stages), progress=progress, device=device)

    if (lw := stages.layerwise) is not None:
        lw_text = text(lw.data)
        try:
            data.layerwise = token_windows(tokenizer, lw_text, _layerwise_windows(lw), lw.window)
        except KVConvertError as exc:
            raise KVConvertError(f"heal_layerwise (data {lw.data!r}): {exc}") from None
        data.info["layerwise"] = {"data": lw.data, "tokens": int(data.layerwise.numel()),
                                  "data_hash": data_hash(data.layerwise)}
    if (ds := stages.distill) is not None:
        data.distill = _distill_windows(text(ds.data), tokenizer, ds)
        data.info["distill"] = {"data": ds.data, "tokens_requested": ds.tokens,
                                "unique_tokens": int(data.distill.numel()), "data_hash": data_hash(data.distill)}
    return data


TEACHER_DATA = "teacher"


def _layerwise_windows(lw: LayerwiseOptions) -> int:
    """Calibration windows of the layer-wise stage: at least 2 fitted, plus the held-out ones."""
    return max(2, lw.tokens // lw.window) + LAYERWISE_VAL_WINDOWS


def _distill_windows_needed(ds: DistillOptions) -> int:
    """seq_len windows one process trains on (with repeats)."""
    return ds.steps * ds.batch_size * ds.grad_accum


def teacher_tokens_needed(stages: HealStages) -> int:
    """Tokens the teacher must write for the stages with `data: teacher` (10% spare for the
    windows' cut points and re-tokenization)."""
    need = 0
    if (lw := stages.layerwise) is not None and lw.data == TEACHER_DATA:
        need = max(need, _layerwise_windows(lw) * lw.window)
    if (ds := stages.distill) is not None and ds.data == TEACHER_DATA:
        # the distiller reuses the windows up to max_epochs times: that many fewer unique tokens
        need = max(need, math.ceil(_distill_windows_needed(ds) / ds.max_epochs) * ds.seq_len)
    return int(need * 1.1) + 1


def _distill_windows(text: str, tokenizer, ds: DistillOptions) -> torch.Tensor:
    """All whole seq_len windows of the data, [N, seq_len]; the run reuses them at most
    max_epochs times (the order is drawn per epoch by the distiller)."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    available = ids.numel() // ds.seq_len
    need = _distill_windows_needed(ds)
    if available * ds.max_epochs < need:
        raise KVConvertError(
            f"heal_distill (data {ds.data!r}): data too short: {available * ds.seq_len} tokens in whole {ds.seq_len}-token "
            f"windows, need {need * ds.seq_len} (tokens) / max_epochs {ds.max_epochs}; use more data, fewer tokens "
            "or a larger max_epochs")
    return ids[: available * ds.seq_len].view(available, ds.seq_len)[:need]


def heal_stages(student: str | Path, teacher: str | Path, stages: HealStages, out: str | Path, *,
                overwrite: bool = False, progress: bool = True, restart: bool = False,
                max_steps: int | None = None) -> dict:
    """Heal `student` (a `kvconvert mla` output) against `teacher` (its source) into `out` with the
    stages' options, each on its own `device` (kvconvert.recipe.heal: from a recipe file, preset or dict).

    max_steps: stop the distillation after this many optimizer steps, keep the state and return
    {"finished": False} (rerun to resume). restart: discard any saved state first. Returns the report.
    """
    t0 = time.time()
    if stages.layerwise is None and stages.distill is None:
        raise KVConvertError("the recipe has no enabled heal_layerwise or heal_distill stage: nothing to heal")
    student, teacher, out = Path(student), resolve_source(teacher), Path(out)
    check_output_path(out, overwrite, needed_bytes=estimate_checkpoint_bytes(student), sources=(student, teacher))
    s_reader, t_reader = CheckpointReader(student), CheckpointReader(teacher)
    for reader in (s_reader, t_reader):
        check_checkpoint(reader)  # config, missing tensors, tokenizer files, NaN/inf: before any work
    notes = compat.check_pair(s_reader, t_reader)
    tokenizer = load_tokenizer(teacher)
    # each stage's device resolved now: a GPU asked for and missing is a clear error before any work
    devices = {name: str(resolve_device(opts.device)) for name, opts in
               (("heal_layerwise", stages.layerwise), ("heal_distill", stages.distill)) if opts is not None}
    data = prepare_data(tokenizer, stages, teacher, progress, next(iter(devices.values())))
    state = state_dir_for(out)
    if restart and state.exists():
        shutil.rmtree(state)
    # the device is left out: a run interrupted on one device resumes on another
    fp = fingerprint(_without_device(stages.to_dict()), checkpoint_fingerprint(student),
                     checkpoint_fingerprint(teacher), data.info)
    report = {"student": str(student), "teacher": str(teacher), "recipe": stages.to_dict(), "data": data.info,
              "notes": notes, "stages": {}}
    if stages.distill is not None and progress:
        _print_plan(student, teacher, stages.distill, devices["heal_distill"])
    current = student
    if stages.layerwise is not None:
        target = out if stages.distill is None else state / "layerwise-checkpoint"
        report["stages"]["heal_layerwise"] = _layerwise_stage(
            s_reader, t_reader, data, stages.layerwise, target, state, fp, report, progress,
            devices["heal_layerwise"], final=stages.distill is None, overwrite=overwrite)
        current = target
    if stages.distill is not None:
        result = _distill_stage(current, teacher, data, stages.distill, out, state, fp, report, progress,
                                max_steps, overwrite)
        report["stages"]["heal_distill"] = result
        if not result.get("finished", True):
            report["finished"] = False
            return report
    report["finished"] = True
    report["seconds"] = round(time.time() - t0, 1)
    shutil.rmtree(state, ignore_errors=True)
    return report


def _print_plan(student: Path, teacher: Path, stage: DistillOptions, device: str) -> None:
    """The distillation's plan on stderr before any stage runs (kvconvert.heal.memory.plan_lines)."""
    import sys

    from kvconvert.checkpoint import read_config
    from kvconvert.heal.memory import plan_lines

    kind = torch.device(device).type
    name = torch.cuda.get_device_name(torch.device(device)) if kind == "cuda" else ""
    for line in plan_lines(read_config(student), read_config(teacher), stage, kind, name):
        print(line, file=sys.stderr, flush=True)


def _without_device(recipe: dict) -> dict:
    return {k: ({kk: vv for kk, vv in v.items() if kk != "device"} if k in HEAL_BLOCKS else v)
            for k, v in recipe.items()}


@contextmanager
def _stage_writer(target: Path, s_reader: CheckpointReader, report: dict, stage_info: dict, overwrite: bool):
    """CheckpointWriter of a stage's output: the converter's manifest entries (source, rank,
    rope_dim, calibration) kept and the healing's added; after the body's tensors, the student's
    config and tokenizer."""
    manifest = read_manifest(s_reader.path)
    extra = {k: v for k, v in manifest.items() if k.startswith("kvconvert_") and k != "kvconvert_heal"}
    extra["kvconvert_heal"] = {"student": report["student"], "teacher": report["teacher"],
                               "recipe": report["recipe"], "data": report["data"], **stage_info}
    with CheckpointWriter(target, overwrite=overwrite, source=manifest.get("source") or report["teacher"],
                          manifest_extra=extra) as writer:
        yield writer
        writer.write_config(s_reader.config)
        writer.copy_tokenizer(s_reader.path)


def _write_report(writer: CheckpointWriter, report: dict, stage: str, result: dict) -> None:
    writer.write_json("heal_report.json", {**report, "stages": {**report["stages"], stage: result}})


def _layerwise_stage(s_reader, t_reader, data: HealData, stage: LayerwiseOptions, target: Path, state: Path, fp: str,
                     report: dict, progress: bool, device: str, final: bool, overwrite: bool) -> dict:
    from kvconvert.heal.layerwise import LayerwiseState, copy_globals, run_layerwise

    done_flag = state / "layerwise.done"
    if not final and done_flag.is_file() and done_flag.read_text() == fp and (target / "config.json").is_file():
        return json.loads((state / "layerwise-report.json").read_text())
    t0 = time.time()
    lw_state = LayerwiseState(state / "layerwise", fp)
    with _stage_writer(target, s_reader, report, {"stage": "heal_layerwise"}, overwrite or not final) as writer:
        copy_globals(s_reader, writer)
        layers = run_layerwise(s_reader, t_reader, data.layerwise, stage, writer, lw_state, device, progress,
                               LAYERWISE_VAL_WINDOWS)
        result = {"layers": layers, "seconds": round(time.time() - t0, 1), **_layer_summary(layers)}
        _write_report(writer, report, "heal_layerwise", result)
    if not final:
        (state / "layerwise-report.json").write_text(json.dumps(result))
        done_flag.write_text(fp)
    return result


def _layer_summary(layers: list[dict]) -> dict:
    summary = {}
    for key in ("rel_err_before", "rel_err_after", "val_rel_err_before", "val_rel_err_after"):
        vals = [r[key] for r in layers if key in r]
        summary[f"mean_{key}"] = sum(vals) / len(vals) if vals else None
    return summary


def _distill_stage(student: Path, teacher: Path, data: HealData, stage: DistillOptions, out: Path, state: Path,
                   fp: str, report: dict, progress: bool, max_steps: int | None, overwrite: bool) -> dict:
    from kvconvert.heal.distill import Distiller, plot_loss_curve, summarize, write_history

    distiller = Distiller(student, teacher, data.distill, stage, state / "distill", fp, progress)
    resumed_at = distiller.step if distiller.try_resume() else 0
    result = distiller.run(max_steps)
    info = {"resumed_at_step": resumed_at, "steps_done": result.steps_done, "steps": distiller.steps,
            "finished": result.finished, **summarize(result.history), "sharding": distiller.sharding}
    if not result.finished or not distiller.accelerator.is_main_process:
        return info
    s_reader = CheckpointReader(student)
    stage_info = {"stage": "heal_distill", "distill_tokens": info.get("tokens", 0)}
    with _stage_writer(out, s_reader, report, stage_info, overwrite) as writer:
        for name in s_reader.keys():
            tensor = s_reader.get(name)
            writer.add(name, result.weights[name].to(tensor.dtype) if name in result.weights else tensor)
        write_history(result.history, writer.tmp_dir / "distill_history.jsonl")
        plot_loss_curve(result.history, writer.tmp_dir / "loss_curve.png")
        _write_report(writer, report, "heal_distill", info)
    return info
