"""The whole job on one model (`kvconvert pipeline`, kvconvert.commands.pipeline): convert to MLA
(-> heal) -> calibrate KV scales -> validate against the source -> gate. Without a conversion a recipe's
heal_distill (with kv_dtype) heals the source itself for its cache before the calibration.

Every stage runs in this process through the library, with the same options model its command
takes (kvconvert.stage_options), and is printed first as the equivalent `kvconvert ...` command
line, so the pipeline doubles as documentation of the individual commands. A stage whose output
already exists is reused (unless --overwrite), so an interrupted pipeline continues where it stopped.

With --recipe, the recipe's blocks drive every stage: `convert` is the conversion's options, the
heal blocks heal it (`kvconvert mla --heal RECIPE`), `calibrate` the calibration's (no block: the KV
cache stays unquantized), `validate` the validation's and the gate policy. A key the recipe leaves
out takes the stage's own default.

convert_stage is the conversion and its healing chain, shared with `kvconvert mla --heal`.
"""

from __future__ import annotations

import gc
import json
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from pydantic import Field

from kvconvert.device import DEVICE_FIELD
from kvconvert.errors import KVConvertError
from kvconvert.eval.options import ValidateOptions
from kvconvert.eval.suites import SUITES
from kvconvert.kvformat import CALIBRATE_KV_DTYPES, kv_dtype_slug, kv_dtype_type, kv_pair, pair_help
from kvconvert.mla.options import MLAOptions
from kvconvert.plan import PlanOptions
from kvconvert.quant.options import CalibrateOptions
from kvconvert.stage_options import StageOptions, build_options, field_like, options_as_flags
from kvconvert.targets import TARGETS


def to_stderr(msg: str, color: str | None = None) -> None:
    """Where the pipeline's progress lines go unless the caller says (kvconvert.commands.pipeline colours them)."""
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ convert (+ heal): also `kvconvert mla`

def heal_recipe(heal: str):
    """--heal none | a preset (layerwise, layerwise+distill) | a recipe YAML -> the Recipe, or None;
    checked before any conversion work."""
    from kvconvert.recipe import resolve_recipe

    if heal == "none":
        return None
    try:
        recipe = resolve_recipe(heal)
    except KVConvertError as exc:
        raise KVConvertError(f"--heal {heal}: {exc}; use none, a preset or a recipe .yaml file") from None
    if not recipe.heals():
        raise KVConvertError(f"--heal {heal}: the recipe has no enabled heal_layerwise or heal_distill block")
    return recipe


def convert_stage(src_path: Path, opts: MLAOptions, out: Path, heal=None, *, source_name: str | None = None,
                  overwrite: bool = False):
    """Convert src_path into `out`; with a heal Recipe, convert into a hidden one-shot folder beside
    `out`, heal it against the source into `out`, and remove the one-shot folder. Returns the
    conversion report (kvconvert.mla.convert.ConversionReport)."""
    from kvconvert.mla.convert import convert_to_mla

    if heal is None:
        return convert_to_mla(src_path, out, opts, source_name=source_name, overwrite=overwrite)
    from kvconvert.recipe import heal as run_heal

    oneshot = out.parent / f".{out.name}.oneshot"
    try:
        report = convert_to_mla(src_path, oneshot, opts, source_name=source_name, overwrite=True)
        # a device given to the conversion (--device, the recipe's convert block) is the heal's too;
        # otherwise each heal block keeps its own. The caller applied its --overwrite to out.
        device = opts.device if "device" in opts.model_fields_set else None
        run_heal(oneshot, src_path, heal, out, overwrite=True, device=device)
    finally:
        shutil.rmtree(oneshot, ignore_errors=True)
    return report


# ------------------------------------------------------------------ the stages

@dataclass
class Stage:
    name: str  # convert | heal (the source, no conversion) | calibrate | export | validate | gate
    argv: list[str]  # the equivalent command line, after `kvconvert`
    out: Path | None  # output folder, reused when it holds a manifest; None: the stage always runs
    options: StageOptions | None  # what the stage runs with (argv is built from it)
    run: Callable[[], bool | None]  # runs the stage in this process; False: the gate failed
    source: str | None = None  # the model it reads: its `out` is reused only when recorded as built from it
    makes: dict | None = None  # more of what decides its output (the heal recipe), for the provenance record
    prebuilt: Path | None = None  # the same build made by `kvconvert plan` (--kv-budget): used when its record matches

    @property
    def command(self) -> str:
        return "kvconvert " + shlex.join(self.argv)

    def provenance(self) -> dict:
        """What decides the stage's output besides its source's weights (kvconvert.checkpoint.provenance);
        the device is left out: it moves the work, not what is made."""
        from kvconvert.checkpoint.provenance import stage_record

        return stage_record(self.name, self.options, **(self.makes or {}))


def _convert(src: str, opts: MLAOptions, heal, heal_shown: str, out: Path) -> Stage:
    def run():
        from kvconvert.checkpoint import check_checkpoint
        from kvconvert.sources import resolve_source

        src_path = resolve_source(src)
        check_checkpoint(src_path)
        convert_stage(src_path, opts, out, heal, source_name=src, overwrite=True)

    argv = ["mla", "--src", src, *options_as_flags(opts), "--heal", heal_shown, "--out", str(out), "--overwrite"]
    return Stage("convert", argv, out, opts, run, source=src,
                 makes={"heal": heal.to_dict() if heal is not None else None})


def _heal_source(src: str, heal, heal_shown: str, out: Path) -> Stage:
    """The source distilled against itself with its KV cache rounded as the engine stores it (the recipe's
    heal_distill.kv_dtype; kvconvert.heal.quant_aware), into `out`: a checkpoint of the source's architecture."""
    from kvconvert.recipe import heal_blocks

    def run():
        from kvconvert.checkpoint import check_checkpoint
        from kvconvert.recipe import heal as run_heal
        from kvconvert.sources import resolve_source

        src_path = resolve_source(src)
        check_checkpoint(src_path)
        run_heal(src_path, src_path, heal, out, overwrite=True)

    argv = ["heal", "--student", src, "--teacher", src, "--recipe", heal_shown, "--out", str(out), "--overwrite"]
    return Stage("heal", argv, out, None, run, source=src, makes={"heal": heal_blocks(heal)})


def _calibrate(model: str, opts: CalibrateOptions, out: Path) -> Stage:
    def run():
        from kvconvert.quant.run import CalibrateJob, run_calibrate

        run_calibrate(CalibrateJob(src=model, options=opts, out=out, overwrite=True),
                      echo=to_stderr)

    argv = ["calibrate", "--src", model, *options_as_flags(opts, keep=("kv_dtype",)), "--out", str(out), "--overwrite"]
    return Stage("calibrate", argv, out, opts, run, source=model)


def _validate(src: str, candidate: str, opts: ValidateOptions, report_dir: Path) -> Stage:
    def run():
        from kvconvert.eval.report import print_summary
        from kvconvert.eval.cache import source_results_dir
        from kvconvert.eval.validate import run_validate

        # the source's results kept across runs: a second pipeline on the same source does not measure it again
        print_summary(run_validate(src, candidate, report_dir, opts, shared=source_results_dir()))

    argv = ["validate", "--source", src, "--candidate", candidate, *options_as_flags(opts, keep=("kv_dtype", "suite")),
            "--out", str(report_dir)]
    return Stage("validate", argv, None, opts, run)


def _export_gguf(model: str, out: Path, kv_dtype: str) -> Stage:
    """The model as a GGUF file for stock llama.cpp (kvconvert export-gguf), with the cache flags to serve it."""
    def run():
        from kvconvert.checkpoint.gguf_export import export_gguf
        from kvconvert.engines.gguf_options import GGUFExportOptions
        from kvconvert.sources import resolve_source

        export_gguf(resolve_source(model), out, GGUFExportOptions(), overwrite=True, name=Path(model).name)
        to_stderr(f"llama.cpp serves it with: {llamacpp_flags(kv_dtype, out)}")

    return Stage("export", ["export-gguf", "--src", model, "--out", str(out), "--overwrite"], None, None, run)


def llamacpp_flags(kv_dtype: str, gguf: Path | str) -> str:
    """How stock llama.cpp serves a GGUF with a kvconvert KV format: its cache type flags (flash attention on for
    a quantized cache, which llama.cpp needs for a quantized V)."""
    pair = kv_pair(kv_dtype)
    caches = [fmt.ggml_type or {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}.get(fmt.name) for fmt in (pair.k, pair.v)]
    if None in caches:
        raise KVConvertError(f"llama.cpp has no {pair.title} cache: its caches are f32, f16, bf16, q8_0, q5_1, q5_0, "
                             "q4_1, q4_0 and iq4_nl")
    flags = f"-ctk {caches[0]} -ctv {caches[1]}" + (" -fa on" if pair.quantized else "")
    return f"llama-cli -m {gguf} {flags}"


def _gate(report_dir: Path, policy_file: str) -> Stage:
    def run():
        from kvconvert.eval.gate import run_gate

        return run_gate(report_dir / "report.json", Path(policy_file))

    return Stage("gate", ["gate", "--report", str(report_dir / "report.json"), "--policy", policy_file], None, None, run)


def build_stages(src: str, convert: MLAOptions | None, heal, heal_shown: str, calibrate: CalibrateOptions | None,
                 validate: ValidateOptions, policy_file: str, out_dir: Path, gguf: bool = False) -> list[Stage]:
    """convert into out_dir/mla (convert given), then (calibrate given) calibrate that (or the source
    itself: "don't convert, just quantize") into out_dir/<mla|source>-<kv_dtype>, then (gguf, or a cache in one of
    llama.cpp's types) write that as out_dir/<mla|source>-<kv_dtype>.gguf for stock llama.cpp, validate the last
    model against the source into out_dir/report, gate the report."""
    if convert is None and calibrate is None:
        raise KVConvertError("nothing to build: no MLA conversion and no KV calibration (give one of them)")
    from kvconvert.recipe import heal_cache_mismatch, source_heal_problem

    problem = heal_cache_mismatch(heal.distill if heal is not None else None, calibrate)
    if problem:  # a recipe checks itself; --heal RECIPE with --kv-dtype composes two sources
        raise KVConvertError(f"{heal_shown}: {problem}")
    if calibrate is not None:  # a K/V pair for the MLA row the conversion writes: refused before it runs
        kv_pair(calibrate.kv_dtype).check_cache_kind(is_mla=convert is not None)
    stages, model, name = [], src, "source"
    if convert is not None:
        model, name = str(out_dir / "mla"), "mla"
        stages.append(_convert(src, convert, heal, heal_shown, Path(model)))
    elif heal is not None:  # no conversion: the source itself, healed for its cache
        problem = source_heal_problem(heal.layerwise, heal.distill)
        if problem:
            raise KVConvertError(f"{heal_shown}: {problem}")
        model, name = str(out_dir / "healed"), "healed"
        stages.append(_heal_source(src, heal, heal_shown, Path(model)))
    if calibrate is not None:
        stages.append(_calibrate(model, calibrate, out_dir / f"{name}-{kv_dtype_slug(calibrate.kv_dtype)}"))
        model = str(stages[-1].out)
    kv = calibrate.kv_dtype if calibrate is not None else "bf16"
    if gguf or kv_pair(kv).ggml_types:
        stages.append(_export_gguf(model, out_dir / f"{name}-{kv_dtype_slug(kv)}.gguf", kv))
    return stages + [_validate(src, model, validate, out_dir / "report"), _gate(out_dir / "report", policy_file)]


DEFAULT_POLICY = "default"  # recipes/gates/default.yaml: the gate when neither --policy nor the recipe names one


def _policy_path(policy: str, base: Path | None = None) -> str:
    """A policy file (as given, or relative to `base`, the recipe's folder) or a built-in name."""
    from kvconvert.resources import find_policy

    return str(find_policy(policy, base))


def with_device(opts: StageOptions | None, device: str | None) -> StageOptions | None:
    """The options with `device` set (validated by the model), or unchanged when device is None."""
    if opts is None or device is None:
        return opts
    return build_options(type(opts), {}, base=opts.model_dump(exclude_unset=True), device=device)


def recipe_stages(recipe, recipe_path: Path, src: str, out_dir: Path, device: str | None = None) -> list[Stage]:
    """The pipeline's stages for a recipe (`device`: replaces every block's device when given)."""
    convert = recipe.stage("convert")
    calibrate = recipe.stage("calibrate")
    if convert is None and calibrate is None:
        raise KVConvertError(f"{recipe_path}: the pipeline needs a `convert` or a `calibrate` block")
    block = recipe.validate_
    validate = recipe.stage("validate") or ValidateOptions()
    if validate.kv_dtype == "auto" and calibrate is not None:  # the calibrated format, unless the recipe says
        validate = validate.model_copy(update={"kv_dtype": calibrate.kv_dtype})
    policy = _policy_path(block.gate if block is not None and block.gate else DEFAULT_POLICY, recipe_path.parent)
    heal = recipe if recipe.heals() else None
    convert, calibrate, validate = (with_device(o, device) for o in (convert, calibrate, validate))
    gguf = convert is not None and convert.target == "llamacpp"  # (a llama.cpp cache type exports in any case)
    return build_stages(src, convert, heal, str(recipe_path) if heal else "none", calibrate, validate, policy, out_dir,
                        gguf)


def run_stages(stages: list[Stage], overwrite: bool, echo=to_stderr) -> list[dict]:
    """Run the stages in order (reusing a finished one's output unless `overwrite`, or the plan's build of
    the stage, see adopt_prebuilt); the log of each stage's command, seconds and exit code (the gate's: 1
    when it failed). echo(line, color): the progress lines."""
    from kvconvert.checkpoint.provenance import record_artifact, reuse_problem
    from kvconvert.sources import resolve_source

    log = []
    for stage in stages:
        if not overwrite and stage.out is not None and (stage.out / "manifest.json").is_file():
            problem = reuse_problem(stage.out, resolve_source(stage.source), stage.provenance())
            if problem is None:
                echo(f"\n== {stage.name}: reusing {stage.out}, built from {stage.source} with these options "
                     "(--overwrite recomputes it)", "cyan")
                log.append({"stage": stage.name, "command": stage.command, "seconds": 0.0, "exit_code": 0,
                            "reused": True})
                continue
            echo(f"\n== {stage.name}: not reusing {stage.out}: {problem}; rebuilding it", "yellow")
        if adopt_prebuilt(stage, echo):
            log.append({"stage": stage.name, "command": stage.command, "seconds": 0.0, "exit_code": 0,
                        "reused": True, "from_plan": str(stage.prebuilt)})
            continue
        echo(f"\n== {stage.name}: {stage.command}", "cyan")
        t0 = time.time()
        try:
            passed = stage.run()
        except KVConvertError:
            echo(f"pipeline stage {stage.name!r} failed; rerun it alone: {stage.command}")
            raise
        gc.collect()  # the stage's models and tensors go before the next stage loads its own
        if stage.out is not None:  # what made it, so a rerun reuses it only for the same source and options
            record_artifact(stage.out, resolve_source(stage.source), stage.provenance())
        log.append({"stage": stage.name, "command": stage.command, "seconds": round(time.time() - t0, 1),
                    "exit_code": 1 if passed is False else 0})
    return log


def adopt_prebuilt(stage: Stage, echo=to_stderr) -> bool:
    """Use the plan's build of this stage (stage.prebuilt: `kvconvert plan` built the candidate it chose from the
    recipe's own blocks, kvconvert.plan.recipe_blocks) as the stage's output, when its provenance record says it
    was built from the stage's source weights with the stage's options and is unchanged since (hard links: no
    copy). With --overwrite too: the plan rebuilt it in this run. False (and the stage runs) otherwise."""
    from kvconvert.checkpoint.provenance import adopt_artifact
    from kvconvert.sources import resolve_source

    if stage.prebuilt is None or stage.out is None:
        return False
    problem = adopt_artifact(stage.prebuilt, stage.out, resolve_source(stage.source), stage.provenance())
    if problem is not None:
        echo(f"\n== {stage.name}: not using the plan's build {stage.prebuilt}: {problem}; building it", "yellow")
        return False
    echo(f"\n== {stage.name}: {stage.out} is the plan's build ({stage.prebuilt}: built from {stage.source} "
         f"with the recipe's options and measured by the plan), not built again; the command it stands for: "
         f"{stage.command}", "cyan")
    return True


# ------------------------------------------------------------------ the job (its command: kvconvert.commands.pipeline)

RECIPE_OWNS = ("rank", "rope_dim", "target", "heal", "calib_tokens", "kv_dtype", "suite", "policy")


class PipelineOptions(StageOptions):
    """`kvconvert pipeline`'s flags (without --recipe). Each one that sets a stage's field is that field, with
    its limits and help (field_like); None leaves every stage its own default."""

    mla: bool = Field(True, description="--no-mla: keep the source's attention and only calibrate its KV cache "
                                        "(\"don't convert, just quantize\").")
    rank: int | None = field_like(MLAOptions.model_fields["rank"], default=None, description=(
        "kv_lora_rank of the MLA conversion (default: the largest latent the --target engine serves)."))
    rope_dim: int | None = field_like(MLAOptions.model_fields["rope_dim"],
                                      description="qk_rope_head_dim (default: with --rank's default).")
    target: Literal[tuple(TARGETS)] = field_like(MLAOptions.model_fields["target"],
                                                 description="Engine the checkpoint is for (see `kvconvert mla --target`).")
    heal: str = Field("layerwise", description="none, layerwise or a recipe YAML.")
    calib_tokens: int | None = field_like(MLAOptions.model_fields["calib_tokens"], default=None, description=(
        "Calibration tokens for both convert and calibrate (default: each command's own default)."))
    kv_dtype: kv_dtype_type((*CALIBRATE_KV_DTYPES, "bf16")) = Field(  # calibrate's default; its checks take no bf16
        CalibrateOptions.model_fields["kv_dtype"].default, description="KV cache format (bf16: not quantized, no calibration). "
        + pair_help((*CALIBRATE_KV_DTYPES, "bf16")) + " A pair is llama.cpp's, for the source's own attention (--no-mla).")
    suite: Literal[tuple(SUITES)] = field_like(ValidateOptions.model_fields["suite"])
    policy: str = Field(DEFAULT_POLICY, description="Gate policy: a YAML file or a built-in name.")
    kv_budget: str | None = Field(None, description=(
        "Let `kvconvert plan` measure what fits this share of the source's bf16 KV bytes (e.g. 50%) and the --target "
        "engine, then build and validate the winner from its recipe (OUT/plan)."))
    kv_dtypes: tuple[str, ...] | None = field_like(PlanOptions.model_fields["kv_dtypes"], description=(
        "With --kv-budget: the KV formats the plan considers (e.g. q4_0,iq4_nl); default: every format."))
    device: str | None = field_like(DEVICE_FIELD, default=None, description=(
        "Where every stage runs: auto (cuda when visible), cpu, cuda[:N] (default: each stage's own, auto)."))


def run_pipeline(src: str, recipe_file: Path | None, opts: PipelineOptions, out_dir: Path, overwrite: bool = False,
                 given: frozenset[str] = frozenset(), echo=to_stderr) -> dict:
    """The stages (of the flags' `opts`, of the recipe, or of the plan for opts.kv_budget), run in order into
    `out_dir`, their log in out_dir/pipeline.json. `given`: the parameters the command line gave, refused where
    the recipe or the plan sets them. Returns {"src", "stages", "log", "planned" (seconds the plan took)}."""
    from kvconvert.checkpoint import atomic_write_text, check_writable

    t0 = time.time()
    if recipe_file is None:  # --out vs --src before any work (the plan of --kv-budget included)
        _check_out(out_dir, src)
    _check_existing_out(out_dir, overwrite)  # a folder that is not a pipeline's: refused before the plan too
    if opts.kv_budget is None:
        _refuse_given(given, ("kv_dtypes",), "the formats a plan considers: give it with --kv-budget, or one "
                                             "format with --kv-dtype")
    if opts.kv_budget is not None:
        src, stages = _from_plan(src, opts, out_dir, overwrite, given, echo)
    elif recipe_file is not None:
        src, stages = _from_recipe(recipe_file, src, out_dir, opts.device, given)
    else:
        stages = _from_options(src, opts, out_dir, given)
    if recipe_file is not None:  # the recipe's source is known now
        _check_out(out_dir, src)
    check_writable(out_dir)  # before the first stage (kvconvert.checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_file = out_dir / PIPELINE_LOG
    atomic_write_text(log_file, json.dumps({"stages": [], "running": True}) + "\n")  # marks --out as this pipeline's
    planned = time.time() - t0  # --kv-budget: the plan (0 when a finished plan was reused)
    log = run_stages(stages, overwrite, echo)
    if opts.kv_budget is not None:
        log.insert(0, {"stage": "plan", "command": _plan_command(src, opts, out_dir, given)[1],
                       "seconds": round(planned, 1), "exit_code": 0})
    atomic_write_text(log_file, json.dumps({"stages": log, "seconds": round(time.time() - t0, 1)}, indent=2))
    return {"src": src, "stages": stages, "log": log, "planned": planned}


PIPELINE_LOG = "pipeline.json"  # the stages' log; written first, so an --out holding it is a pipeline's


def _check_existing_out(out_dir: Path, overwrite: bool) -> None:
    """An --out that exists, is not empty and is not a pipeline's own folder is refused as mla and calibrate refuse
    an existing output, unless --overwrite: the pipeline writes pipeline.json, provenance.json, report/, plan/ and
    the stages' folders into it. A pipeline's folder (its pipeline.json; an interrupted run's provenance.json, or
    only the plan/ of --kv-budget) is its own to resume: its stages are reused where their provenance matches."""
    from kvconvert.checkpoint.provenance import PROVENANCE_FILE
    from kvconvert.checkpoint.writer import refuse_existing_outputs

    entries = {p.name for p in out_dir.iterdir() if not p.name.startswith(".")} if out_dir.is_dir() else set()
    log, records = _json_or_none(out_dir / PIPELINE_LOG), _json_or_none(out_dir / PROVENANCE_FILE)
    ours = (not entries or entries == {"plan"} or (isinstance(log, dict) and isinstance(log.get("stages"), list))
            or (isinstance(records, dict) and all(isinstance(r, dict) and "format_version" in r
                                                  for r in records.values())))
    if not ours:
        refuse_existing_outputs([out_dir], overwrite)


def _json_or_none(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _from_options(src: str, opts: PipelineOptions, out_dir: Path, given: frozenset[str]) -> list[Stage]:
    """The stages of the flags: --no-mla skips the conversion; no --rank: the largest shape --target serves."""
    rank, rope_dim = opts.rank, opts.rope_dim
    if not opts.mla:
        _refuse_given(given, ("rank", "rope_dim", "heal"),
                      "belong to the MLA conversion, which --no-mla skips; drop them or --no-mla")
        if "target" in given:
            _check_served(opts.kv_dtype, opts.target)
        rank = None
    elif rank is None:
        rank, rope_dim = _default_shape(src, opts.target, rope_dim)
    return _from_flags(src, rank, rope_dim, opts.target, opts.heal if opts.mla else "none", opts.calib_tokens,
                       opts.kv_dtype, opts.suite, opts.policy, out_dir, opts.device)


def _check_served(kv_dtype: str, target: str) -> None:
    """--target names an engine that does not hold the source's cache in --kv-dtype: refused before any work."""
    pair = kv_pair(kv_dtype)
    if target != "any":
        pair.check_engine(target)  # vLLM, TensorRT-LLM: one cache dtype for K and V, a pair refused by name
    served = pair.served_by(mla=False)
    if target != "any" and target not in served:
        raise KVConvertError(f"--kv-dtype {kv_dtype}: {target} does not serve it (served by {', '.join(served)}); "
                             f"pick a format {target} serves (`kvconvert plan --target {target}` measures them)")


def _check_out(out_dir: Path, src: str) -> None:
    """Before any stage and before --out is made: the pipeline's --out must not be, hold or lie inside
    the source (even with --overwrite), and the source passes the checks that read no weights (index vs
    shards, config, expected tensors, tokenizer files; the first stage scans the weights for NaN)."""
    from kvconvert.checkpoint import check_checkpoint, check_not_source
    from kvconvert.sources import resolve_source

    src_path = resolve_source(src)
    check_not_source(out_dir, (src_path,))
    check_checkpoint(src_path, finite=False)


def _from_flags(src, rank, rope_dim, target, heal, calib_tokens, kv_dtype, suite, policy, out_dir: Path,
                device: str | None = None) -> list[Stage]:
    calib = {"calib_tokens": calib_tokens, "device": device}  # None: not given, the stage's default
    quantized = kv_pair(kv_dtype).quantized
    calibrate = build_options(CalibrateOptions, {"kv_dtype": kv_dtype, **calib}) if quantized else None
    convert = None if rank is None else build_options(MLAOptions, {"rank": rank, "rope_dim": rope_dim,
                                                                   "target": target, **calib})
    validate = build_options(ValidateOptions, {"suite": suite, "kv_dtype": kv_dtype, "device": device})
    return build_stages(src, convert, heal_recipe(heal) if convert else None, heal, calibrate, validate,
                        _policy_path(policy), out_dir, gguf=target == "llamacpp")


FLAG_OF = {"recipe_file": "--recipe"}  # parameters whose flag is not --<name>


def _given_flags(given: frozenset[str], names: tuple[str, ...]) -> str:
    """The flags among the parameters `names` that the command line gave ("--rank, --heal"; "" when none)."""
    return ", ".join(FLAG_OF.get(name, "--" + name.replace("_", "-")) for name in names if name in given)


def _refuse_given(given: frozenset[str], names: tuple[str, ...], why: str) -> None:
    """KVConvertError "FLAGS: why" when the command line gave any of the parameters `names`."""
    flags = _given_flags(given, names)
    if flags:
        raise KVConvertError(f"{flags}: {why}")


def _default_shape(src: str, target: str, rope_dim: int | None) -> tuple[int, int]:
    """The largest MLA latent the target engine serves that is smaller than the source's K+V."""
    from kvconvert.checkpoint import read_config
    from kvconvert.kvmath import head_dim
    from kvconvert.sources import resolve_source
    from kvconvert.targets import get_target, servable_shapes

    cfg = read_config(resolve_source(src))
    kv_heads, d = cfg.get("num_key_value_heads", cfg["num_attention_heads"]), head_dim(cfg)
    engine = get_target(target)
    if engine.latent_sizes is None:
        raise KVConvertError(f"--target {target} serves every shape: give --rank (and --rope-dim)")
    shapes = [(r, p) for r, p in servable_shapes(engine, kv_heads, d)
              if r + p < 2 * kv_heads * d and rope_dim in (None, p)]
    if not shapes:
        raise KVConvertError(f"{src}: {target} serves no MLA latent smaller than this model's K+V "
                             f"({2 * kv_heads * d} values per token and layer); quantize its KV cache instead "
                             "(kvconvert calibrate) or pass --target any with --rank")
    return shapes[0]


def _from_recipe(recipe_file: Path, src: str, out_dir: Path, device: str | None = None,
                 given: frozenset[str] = frozenset()) -> tuple[str, list[Stage]]:
    from kvconvert.recipe import load_recipe

    _refuse_given(given, RECIPE_OWNS, f"set by the recipe ({recipe_file}); change the recipe instead")
    recipe = load_recipe(recipe_file)
    if recipe.source and "src" in given and src != recipe.source:
        raise KVConvertError(f"--src {src}: the recipe's source is {recipe.source}; drop --src or edit the recipe")
    src = recipe.source or src
    return src, recipe_stages(recipe, recipe_file, src, out_dir, device)


def _from_plan(src: str, opts: PipelineOptions, out_dir: Path, overwrite: bool, given: frozenset[str] = frozenset(),
               echo=to_stderr) -> tuple[str, list[Stage]]:
    """`kvconvert plan` (its defaults, with --target, --device and --calib-tokens) into out_dir/plan, or the
    finished plan there when it was made for this source's weights, budget and options and its recipe.yaml is the
    one it chose (a plan that does not match is refused unless `overwrite`: it plans again); the recipe must build
    what --target serves. Then the stages of that recipe, validated with --suite and gated with --policy when
    given."""
    from kvconvert.plan import PLAN_FILES, parse_budget, plan_problem, run_plan
    from kvconvert.recipe import load_recipe
    from kvconvert.sources import resolve_source

    _refuse_given(given, ("recipe_file", "mla", "rank", "rope_dim", "kv_dtype", "heal"),
                  "--kv-budget lets `kvconvert plan` choose these; drop them or --kv-budget")
    budget, plan_dir, src_path = parse_budget(opts.kv_budget), out_dir / "plan", resolve_source(src)
    plan_opts, command = _plan_command(src, opts, out_dir, given)
    recipe_file, stale = plan_dir / "recipe.yaml", None
    reuse = not overwrite and any((plan_dir / name).exists() for name in PLAN_FILES)
    if not reuse:
        echo(f"\n== plan: {command}", "cyan")
        run_plan(src, budget, plan_opts, plan_dir, echo=echo, overwrite=overwrite, rebuild=overwrite)
    else:
        stale = plan_problem(plan_dir, budget, plan_opts, src_path)
    # the plan chooses among what --target serves: a recipe edited behind its back can leave that set
    problems = [p for p in (_unserved(recipe_file, opts.target), stale) if p]
    if problems:
        edited = f"; an edited recipe runs as `kvconvert pipeline --recipe {recipe_file} --out OTHER`" \
            if "was edited" in (stale or "") else ""
        raise KVConvertError(f"{plan_dir}: " + "; and ".join(problems) + "; pass --overwrite to plan again (every "
                             f"stage is rebuilt) or choose another --out{edited}")
    if reuse:
        echo(f"\n== plan: reusing {plan_dir}, made for {src}'s weights with this budget and these options "
             "(--overwrite plans again)", "cyan")
    recipe = _with_validation(load_recipe(recipe_file), opts, given)
    stages = recipe_stages(recipe, recipe_file, src, out_dir, opts.device)
    built = json.loads((plan_dir / "plan.json").read_text()).get("artifacts") or {}
    for stage in stages:  # the plan's builds of the chosen candidate, used where their records match (run_stages)
        if built.get(stage.name):
            stage.prebuilt = Path(built[stage.name])
    return src, stages


def _plan_command(src: str, opts: PipelineOptions, out_dir: Path, given: frozenset[str]) -> tuple[PlanOptions, str]:
    """The options `pipeline --kv-budget` plans with (its --target, --device, --kv-dtypes and, when given,
    --calib-tokens for both calibrations) and the `kvconvert plan` command line that runs that plan: what is
    printed and what pipeline.json records, so that rerunning it plans the same model the same way."""
    calib = {"calib_tokens": opts.calib_tokens, "kv_calib_tokens": opts.calib_tokens} if "calib_tokens" in given else {}
    plan_opts = build_options(PlanOptions, {"target": opts.target, "device": opts.device, "kv_dtypes": opts.kv_dtypes,
                                            **calib})
    argv = ["plan", "--src", str(src), "--kv-budget", str(opts.kv_budget), *options_as_flags(plan_opts, keep=("target",)),
            "--out", str(out_dir / "plan")]
    return plan_opts, "kvconvert " + shlex.join(argv)


def _unserved(recipe_file: Path, target: str) -> str | None:
    """Why `target` does not serve what the recipe builds (kvconvert.targets.engines_serving: its MLA shape and KV
    format), or None (target any: everything is served)."""
    from kvconvert.recipe import load_recipe
    from kvconvert.targets import engines_serving

    if target == "any" or not recipe_file.is_file():  # no recipe: plan_problem says the plan is not finished
        return None
    recipe = load_recipe(recipe_file)
    convert, calibrate = recipe.stage("convert"), recipe.stage("calibrate")
    rank, rope = (convert.rank, convert.rope_dim) if convert is not None else (None, None)
    kv_dtype = calibrate.kv_dtype if calibrate is not None else "bf16"
    engines = engines_serving(kv_dtype, rank, rope)
    if target in engines:
        return None
    built = "the source" if rank is None else f"MLA {rank}+{rope}"
    return (f"{recipe_file} builds {built} with a {kv_dtype} KV cache, which --target {target} does not serve "
            f"(served by: {', '.join(engines) or 'no engine'}; docs/formats.md)")


def _with_validation(recipe, opts: PipelineOptions, given: frozenset[str]):
    """The recipe with the --suite and --policy the command line gave in its validate block (the plan's recipe
    validates with the quick suite and the default gate)."""
    from kvconvert.recipe import parse_recipe

    changes = {**({"suite": opts.suite} if "suite" in given else {}),
               **({"gate": _policy_path(opts.policy)} if "policy" in given else {})}
    if not changes:
        return recipe
    data = recipe.to_dict()
    data["validate"] = {**data.get("validate", {}), **changes}
    return parse_recipe(data, "--suite / --policy")
