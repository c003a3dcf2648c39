"""`heal_stages(student, teacher, stages, out)`: layer-wise reconstruction then distillation, written as
a stock DeepSeek-V3 checkpoint (CheckpointWriter, atomic). `stages` holds the two stages' options
(heal.options.HealStages: a validated kvconvert.recipe.Recipe is one); reading a recipe file or
preset and `--device` are the recipe's: kvconvert.recipe.heal resolves them and calls this.

Order of work, so that every user error surfaces before any training:
  1. something to heal; output path checked
  2. student/teacher pair checked (compat.check_pair: configs, shared weights, tokenizers)
  3. the layer-wise windows tokenized, the distillation's stream opened and its first block read
     (a broken file or too little data -> error)
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
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvconvert.checkpoint import (
    CheckpointReader, CheckpointWriter, check_checkpoint, check_output_path, estimate_checkpoint_bytes, load_tokenizer,
    read_manifest,
)
from kvconvert.data import bundled_text, data_hash
from kvconvert.device import resolve_device
from kvconvert.errors import KVConvertError
from kvconvert.eval.runner import checkpoint_fingerprint
from kvconvert.heal import compat
from kvconvert.heal.options import DistillOptions, HealStages, LayerwiseOptions, without_device
from kvconvert.heal.teacher_data import fingerprint
from kvconvert.sources import resolve_source
from kvconvert.text_sources import TextSource, mix_text, parse_mix, text_source
from kvconvert.token_stream import DataExhausted, WindowStream, first_windows

LAYERWISE_VAL_WINDOWS = 1  # held-out calibration windows, measured per layer (not fitted)


def state_dir_for(out: Path) -> Path:
    out = Path(out).absolute()
    return out.parent / f".{out.name}.heal-state"


@dataclass
class HealData:
    layerwise: torch.Tensor | None = None  # [N, window] token ids
    distill: WindowStream | None = None  # seq_len windows, streamed (kvconvert.token_stream)
    info: dict = field(default_factory=dict)


def prepare_data(tokenizer, stages: HealStages, teacher: Path | None = None, progress: bool = False,
                 device: str = "cpu") -> HealData:
    """Each stage's data: the layer-wise stage's windows tokenized now, the distillation's stream opened
    and its first block read (a broken first file, or data too short to reach the tokens when it is
    smaller than a block, raises here, before any training).

    `data: teacher` in a stage: text sampled from the teacher (kvconvert.heal.teacher_data), enough
    for the larger of the two stages (they share it), generated once and cached."""
    data = HealData()

    @functools.cache  # the two stages may read the same source: resolve (or generate) it once
    def source(name: str) -> TextSource:
        if name != TEACHER_DATA:
            return text_source(name, bundled_text)
        if teacher is None:
            raise KVConvertError("data: teacher needs the teacher model (kvconvert heal --teacher)")
        from kvconvert.heal.teacher_data import sample_teacher_text

        text = sample_teacher_text(teacher, teacher_tokens_needed(stages), progress=progress, device=device)
        return TextSource(TEACHER_DATA, "text", text=text)

    def sources(stage) -> list[tuple[TextSource, float]]:
        return [(source(name), weight) for name, weight in parse_mix(stage.data).items()]

    if (lw := stages.layerwise) is not None:
        stream = WindowStream(sources(lw), tokenizer, lw.window, shuffle=False)
        try:
            data.layerwise = first_windows(stream, _layerwise_windows(lw))
        except DataExhausted as exc:
            raise KVConvertError(f"heal_layerwise (data {mix_text(lw.data)!r}): {exc}") from None
        data.info["layerwise"] = {"data": lw.data, "tokens": int(data.layerwise.numel()),
                                  "data_hash": data_hash(data.layerwise)}
    if (ds := stages.distill) is not None:
        need = _distill_windows_needed(ds)  # in all: N processes take fewer steps, as many windows
        data.distill = WindowStream(sources(ds), tokenizer, ds.seq_len, seed=ds.seed, max_epochs=ds.max_epochs,
                                    limit=need)
        try:
            first = first_windows(data.distill, min(need, data.distill.block))
        except DataExhausted as exc:
            raise KVConvertError(f"heal_distill (data {mix_text(ds.data)!r}): {exc} (the run needs {need * ds.seq_len} "
                                 f"tokens = {need} windows)") from None
        data.info["distill"] = {"data": ds.data, "tokens_requested": ds.tokens, "stream": data.distill.describe(),
                                "first_block_hash": data_hash(first)}
    return data


TEACHER_DATA = "teacher"


def _layerwise_windows(lw: LayerwiseOptions) -> int:
    """Calibration windows of the layer-wise stage: at least 2 fitted, plus the held-out ones."""
    return max(2, lw.tokens // lw.window) + LAYERWISE_VAL_WINDOWS


def _distill_windows_needed(ds: DistillOptions) -> int:
    """seq_len windows one process trains on (with repeats)."""
    return ds.steps * ds.batch_size * ds.grad_accum


def teacher_tokens_needed(stages: HealStages) -> int:
    """Tokens the teacher must write for the stages with `data: teacher` (its share of a mix; 10% spare
    for the windows' cut points and re-tokenization)."""
    need = 0
    if (lw := stages.layerwise) is not None and TEACHER_DATA in (mix := parse_mix(lw.data)):
        need = max(need, math.ceil(_layerwise_windows(lw) * mix[TEACHER_DATA]) * lw.window)
    if (ds := stages.distill) is not None and TEACHER_DATA in (mix := parse_mix(ds.data)):
        # the distiller reuses the windows up to max_epochs times: that many fewer unique tokens
        need = max(need, math.ceil(_distill_windows_needed(ds) * mix[TEACHER_DATA] / ds.max_epochs) * ds.seq_len)
    return int(need * 1.1) + 1


def heal_stages(student: str | Path, teacher: str | Path, stages: HealStages, out: str | Path, *,
                overwrite: bool = False, progress: bool = True, restart: bool = False,
                max_steps: int | None = None, allow_other_teacher: bool = False) -> dict:
    """Heal `student` (a `kvconvert mla` output) against `teacher` (its source) into `out` with the
    stages' options, each on its own `device` (kvconvert.recipe.heal: from a recipe file, preset or dict).

    max_steps: stop the distillation after this many optimizer steps, keep the state and return
    {"finished": False} (rerun to resume). restart: discard any saved state first; overwrite also discards
    state saved with other options (refused otherwise, naming them). allow_other_teacher: heal against a teacher
    whose weights are not the ones the student was converted from (refused otherwise). Returns the report.
    """
    t0 = time.time()
    if stages.layerwise is None and stages.distill is None:
        raise KVConvertError("the recipe has no enabled heal_layerwise or heal_distill stage: nothing to heal")
    student, teacher, out = resolve_source(student), resolve_source(teacher), Path(out)  # a built-in name too
    check_output_path(out, overwrite, needed_bytes=estimate_checkpoint_bytes(student), sources=(student, teacher))
    s_reader, t_reader = CheckpointReader(student), CheckpointReader(teacher)
    for reader in (s_reader, t_reader):
        check_checkpoint(reader)  # config, missing tensors, tokenizer files, NaN/inf: before any work
    notes = compat.check_pair(s_reader, t_reader)
    check_stages_for(s_reader.config, t_reader.config, stages)
    teacher_fp = checkpoint_fingerprint(teacher)
    other = other_teacher(student, teacher, teacher_fp)
    if other and not allow_other_teacher:
        raise KVConvertError(f"{other}; heal against the model it was converted from, or pass --allow-other-teacher "
                             "to distill from this teacher on purpose")
    if other:
        notes.append(f"--allow-other-teacher: {other}")
        print(f"note: --allow-other-teacher: {other}", file=sys.stderr)
    tokenizer = load_tokenizer(teacher)
    # each stage's device resolved now: a GPU asked for and missing is a clear error before any work
    devices = {name: str(resolve_device(opts.device)) for name, opts in
               (("heal_layerwise", stages.layerwise), ("heal_distill", stages.distill)) if opts is not None}
    data = prepare_data(tokenizer, stages, teacher, progress, next(iter(devices.values())))
    state = state_dir_for(out)
    if restart and state.exists():
        shutil.rmtree(state)
    # the device is left out: a run interrupted on one device resumes on another
    recipe, student_fp = without_device(stages.to_dict()), checkpoint_fingerprint(student)
    check_saved_run(state, {**recipe, "student": student_fp, "teacher": teacher_fp, "data": data.info}, overwrite)
    fp = fingerprint(recipe, student_fp, teacher_fp, data.info)
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


def check_stages_for(student_cfg: dict, teacher_cfg: dict, stages: HealStages) -> None:
    """What a stage asks of this student, refused before any stage runs: sequences beyond its positions,
    layer-wise reconstruction of a student
    with the teacher's own attention (nothing converted to reconstruct), a cache format the student's cache
    cannot be stored in (heal.quant_aware)."""
    from kvconvert.kvmath import kv_shape

    limit = student_cfg.get("max_position_embeddings")
    for flag, opts, length in (("--layerwise-window", stages.layerwise, "window"),
                               ("--distill-seq-len", stages.distill, "seq_len")):
        if opts is not None and limit and getattr(opts, length) > limit:
            raise KVConvertError(f"{flag} {getattr(opts, length)} is beyond the student's max_position_embeddings "
                                 f"{limit} (positions it was never trained at): use {limit} or less")
    if stages.layerwise is not None and compat.same_architecture(student_cfg, teacher_cfg):
        raise KVConvertError("heal_layerwise fits converted attention blocks to the teacher's; this student has the "
                             "teacher's own architecture (nothing converted): heal it with heal_distill alone "
                             "(--recipe distill)")
    if stages.distill is not None and stages.distill.kv_dtype is not None:
        from kvconvert.heal.quant_aware import check_quant_aware_dtype

        try:
            check_quant_aware_dtype(stages.distill.kv_dtype, kv_shape(student_cfg))
        except KVConvertError as exc:
            raise KVConvertError(f"heal_distill.kv_dtype: {exc}") from None


def other_teacher(student: Path, teacher: Path, teacher_fp: str) -> str | None:
    """Why `teacher` is not the model `student` was converted from (its manifest's source: the fingerprint the
    conversion recorded, else that of the recorded folder when it is still on disk), or None when it is, or when
    the student records no source (a checkpoint kvconvert did not convert)."""
    manifest = read_manifest(student)
    source = manifest.get("source")
    recorded = (manifest.get("kvconvert_mla") or {}).get("source_fingerprint")
    if not source:
        return None
    if recorded is None:  # converted before the fingerprint was recorded
        folder = Path(str(source)).expanduser()
        if not (folder / "config.json").is_file():
            return None
        recorded = checkpoint_fingerprint(folder)
    if recorded == teacher_fp:
        return None
    return (f"{student} was converted from {source} (weights fingerprint {recorded}), but --teacher {teacher} holds "
            f"other weights (fingerprint {teacher_fp})")


RUN_FILE = "run.json"  # in the state area: what the saved progress was made with


def check_saved_run(state: Path, run: dict, overwrite: bool) -> None:
    """Saved progress in `state` (an interrupted heal) resumes only for the same run: recipe (devices aside),
    student and teacher weights, data. Progress saved by another run is refused, naming what changed (it used to
    be dropped silently and the heal restarted from step 0), unless `overwrite`: then it is discarded, with a
    note. Records `run` for the next rerun."""
    from kvconvert.checkpoint import atomic_write_text
    from kvconvert.checkpoint.provenance import option_changes

    from kvconvert.heal.state import read_json_state

    progress = state.is_dir() and any(p.name != RUN_FILE for p in state.iterdir())
    # progress without a readable record of its run cannot be matched to this one: named, not silently restarted
    saved = read_json_state(state / RUN_FILE) if progress and (state / RUN_FILE).exists() else None
    if progress and isinstance(saved, dict) and saved != run:
        changes = option_changes(saved, json.loads(json.dumps(run, default=str)))
        if not overwrite:
            raise KVConvertError(f"{state}: saved progress of an interrupted heal was made with other options "
                                 f"({changes}); rerun with those to resume it, or pass --overwrite (or --restart) to "
                                 "discard it and start again")
        print(f"note: discarding {state}, saved with other options ({changes}) (--overwrite)", file=sys.stderr)
        shutil.rmtree(state)
    state.mkdir(parents=True, exist_ok=True)
    atomic_write_text(state / RUN_FILE, json.dumps(run, default=str, sort_keys=True) + "\n")


def _print_plan(student: Path, teacher: Path, stage: DistillOptions, device: str) -> None:
    """The distillation's plan on stderr before any stage runs (kvconvert.heal.memory.plan_lines)."""
    import sys

    from kvconvert.checkpoint import read_config
    from kvconvert.heal.memory import plan_lines

    kind = torch.device(device).type
    name = torch.cuda.get_device_name(torch.device(device)) if kind == "cuda" else ""
    for line in plan_lines(read_config(student), read_config(teacher), stage, kind, name):
        print(line, file=sys.stderr, flush=True)


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
        from kvconvert.heal.state import read_json_state

        return read_json_state(state / "layerwise-report.json")
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
    if resumed_at:
        print(f"heal_distill: resuming at step {resumed_at}/{distiller.steps} (saved in {state})", file=sys.stderr)
    result = distiller.run(max_steps)
    # summarize's "steps" counts the history records: the run's total (distiller.steps) is set after it
    info = {**summarize(result.history), "resumed_at_step": resumed_at, "steps_done": result.steps_done,
            "steps": distiller.steps, "finished": result.finished, "sharding": distiller.sharding}
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
