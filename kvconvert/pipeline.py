"""`kvconvert pipeline`: the whole job on one model, as the CLI commands a user would run:
convert to MLA (-> heal) -> calibrate KV scales -> validate against the source -> gate.

Each stage runs as its own `kvconvert ...` process and is printed first, so the pipeline doubles as
documentation of the individual commands. A stage whose output already exists is reused (unless
--overwrite), so an interrupted pipeline continues where it stopped.

With --recipe, the recipe's blocks drive every stage (recipe_stages): `convert` gives the `kvconvert
mla` flags, the heal blocks run through `--heal RECIPE`, `calibrate` gives the `kvconvert calibrate`
flags (no block: the KV cache stays unquantized), `validate` the suite and the gate policy. A key the
recipe leaves out takes the command's own default.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import click

from kvconvert.errors import KVConvertError
from kvconvert.mla.options import MLAOptions
from kvconvert.quant.options import CalibrateOptions
from kvconvert.stage_options import options_as_flags
from kvconvert.targets import DEFAULT_TARGET, TARGETS

REPO_GATES = Path(__file__).resolve().parents[1] / "recipes" / "gates"


def _run(stage: str, args: list[str], log: list) -> None:
    cmd = [sys.executable, "-m", "kvconvert.cli", *args]
    shown = "kvconvert " + " ".join(shlex.quote(a) for a in args)
    click.secho(f"\n== {stage}: {shown}", fg="cyan", err=True)
    t0 = time.time()
    proc = subprocess.run(cmd)
    log.append({"stage": stage, "command": shown, "seconds": round(time.time() - t0, 1), "exit_code": proc.returncode})
    if proc.returncode != 0 and stage != "gate":
        raise KVConvertError(f"pipeline stage {stage!r} failed (exit {proc.returncode}); rerun it alone: {shown}")


def _done(folder: Path, marker: str) -> bool:
    return (folder / marker).is_file()


def _policy_path(policy: str, base: Path | None = None) -> str:
    """A policy file (as given, or relative to `base`, the recipe's folder) or a built-in name."""
    for path in (Path(policy), *((base / policy,) if base is not None else ())):
        if path.is_file():
            return str(path)
    for candidate in (REPO_GATES / f"{policy}.yaml", REPO_GATES / Path(policy).name):
        if candidate.is_file():
            return str(candidate)
    raise KVConvertError(f"--policy {policy}: not a file and not a built-in policy in {REPO_GATES}")


def _commands(src: str, convert: MLAOptions | None, heal: str, calibrate: CalibrateOptions | None,
              out_dir: Path) -> list[tuple[str, list[str]]]:
    """[(stage, kvconvert args)]: `mla` into out_dir/mla (convert given), then (calibrate given)
    `calibrate` of that (or of the source itself: "don't convert, just quantize") into
    out_dir/<mla|source>-<kv_dtype>; each stage's flags come from its options model."""
    if convert is None and calibrate is None:
        raise KVConvertError("nothing to build: no MLA conversion and no KV calibration (give one of them)")
    stages, model, name = [], src, "source"
    if convert is not None:
        model, name = str(out_dir / "mla"), "mla"
        stages.append(("convert", ["mla", "--src", src, *options_as_flags(convert), "--heal", heal,
                                   "--out", model, "--overwrite"]))
    if calibrate is not None:
        stages.append(("calibrate", ["calibrate", "--src", model, *options_as_flags(calibrate, keep=("kv_dtype",)),
                                     "--out", str(out_dir / f"{name}-{calibrate.kv_dtype}"), "--overwrite"]))
    return stages


def recipe_stages(recipe, recipe_path: Path, src: str, out_dir: Path) -> tuple[list[tuple[str, list[str]]], str, str]:
    """The pipeline's commands for a recipe: ([(stage, kvconvert args)] for convert and calibrate,
    the validated candidate's kv_dtype, the gate policy file). Validate and gate follow in run order."""
    convert = recipe.convert.mla_options() if recipe.convert is not None and recipe.convert.enabled else None
    if convert is None and recipe.heals():
        raise KVConvertError(f"{recipe_path}: heal blocks need a `convert` block (rank, rope_dim, ...)")
    heal = str(recipe_path) if recipe.heals() else "none"
    cal = recipe.calibrate if recipe.calibrate is not None and recipe.calibrate.enabled else None
    if convert is None and cal is None:
        raise KVConvertError(f"{recipe_path}: the pipeline needs a `convert` or a `calibrate` block")
    stages = _commands(src, convert, heal, cal.calibrate_options() if cal is not None else None, out_dir)
    kv_dtype = cal.kv_dtype if cal is not None else "auto"
    val = recipe.validate_
    if val is not None and val.kv_dtype != "auto":
        kv_dtype = val.kv_dtype
    policy = _policy_path(val.gate if val is not None and val.gate else "default", recipe_path.parent)
    return stages, kv_dtype, policy


RECIPE_OWNS = ("rank", "rope_dim", "target", "heal", "calib_tokens", "kv_dtype", "suite", "policy")


@click.command("pipeline")
@click.option("--src", default="smollm2-135m", show_default=True, help="Source model (folder, built-in name, hub id).")
@click.option("--recipe", "recipe_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Recipe YAML whose blocks drive every stage (its `source` replaces --src when set).")
@click.option("--mla/--no-mla", "convert", default=True, show_default=True,
              help="--no-mla: keep the source's attention and only calibrate its KV cache (\"don't convert, just "
                   "quantize\").")
@click.option("--rank", type=int, default=None,
              help="kv_lora_rank of the MLA conversion (default: the largest latent the --target engine serves).")
@click.option("--rope-dim", type=int, default=None, help="qk_rope_head_dim (default: with --rank's default).")
@click.option("--target", type=click.Choice(list(TARGETS)), default=DEFAULT_TARGET, show_default=True,
              help="Engine the checkpoint is for (see `kvconvert mla --target`).")
@click.option("--heal", default="layerwise", show_default=True, help="none, layerwise or a recipe YAML.")
@click.option("--calib-tokens", type=click.IntRange(min=512), default=None,
              help="Calibration tokens for both convert and calibrate (default: each command's own default).")
@click.option("--kv-dtype", type=click.Choice(["fp8", "nvfp4", "bf16"]), default="fp8", show_default=True)
@click.option("--suite", default="quick", show_default=True)
@click.option("--policy", default="default", show_default=True, help="Gate policy: a YAML file or a built-in name.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True)
@click.option("--overwrite", is_flag=True, help="Recompute every stage (default: reuse finished stages).")
@click.option("--fail-on-gate", is_flag=True, help="Exit 1 when the gate fails (for CI); default: report and exit 0.")
def pipeline_cmd(src, recipe_file, convert, rank, rope_dim, target, heal, calib_tokens, kv_dtype, suite, policy, out_dir, overwrite,
                 fail_on_gate):
    """Convert -> heal -> calibrate -> validate -> gate, ending with the report table."""
    import json

    from kvconvert.checkpoint import check_writable

    if recipe_file is not None:
        stages, kv_dtype, policy_file, suite, engine, src = _from_recipe(recipe_file, src, out_dir)
    else:
        if not convert:
            _refuse_mla_flags()
            rank = None
        elif rank is None:
            rank, rope_dim = _default_shape(src, target, rope_dim)
        stages = _from_flags(src, rank, rope_dim, target, heal if convert else "none", calib_tokens, kv_dtype, out_dir)
        policy_file, engine = _policy_path(policy), "auto"
    check_writable(out_dir)  # before the first stage (kvconvert.checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    report_dir = out_dir / "report"
    log: list = []
    t0 = time.time()
    candidate = Path(src)
    for stage, args in stages:
        candidate = Path(args[args.index("--out") + 1])
        if overwrite or not _done(candidate, "manifest.json"):
            _run(stage, args, log)
    _run("validate", ["validate", "--source", src, "--candidate", str(candidate), "--kv-dtype", kv_dtype,
                      "--suite", suite, *(["--engine", engine] if engine != "auto" else []),
                      "--out", str(report_dir)], log)
    _run("gate", ["gate", "--report", str(report_dir / "report.json"), "--policy", policy_file], log)
    (out_dir / "pipeline.json").write_text(json.dumps({"stages": log, "seconds": round(time.time() - t0, 1)}, indent=2))
    pictures = sorted(p.name for p in report_dir.glob("*.png"))
    click.echo(f"\nReport: {report_dir / 'report.md'}\nPictures: {', '.join(pictures) or 'none'} in {report_dir}"
               f"\nValidated model: {candidate}\nTotal: {time.time() - t0:.0f} s")
    gate_ok = log[-1]["exit_code"] == 0
    click.secho(f"Gate ({Path(policy_file).name}): {'PASS' if gate_ok else 'FAIL'}", fg="green" if gate_ok else "red")
    if not gate_ok and fail_on_gate:
        sys.exit(log[-1]["exit_code"])


def _from_flags(src, rank, rope_dim, target, heal, calib_tokens, kv_dtype, out_dir: Path) -> list:
    calib = {} if calib_tokens is None else {"calib_tokens": calib_tokens}
    calibrate = None if kv_dtype == "bf16" else CalibrateOptions(kv_dtype=kv_dtype, **calib)
    convert = MLAOptions(rank=rank, rope_dim=rope_dim, target=target, **calib) if rank is not None else None
    return _commands(src, convert, heal, calibrate, out_dir)


def _refuse_mla_flags() -> None:
    ctx = click.get_current_context()
    given = [name for name in ("rank", "rope_dim", "target", "heal")
             if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise KVConvertError(f"{flags}: belong to the MLA conversion, which --no-mla skips; drop them or --no-mla")


def _default_shape(src: str, target: str, rope_dim: int | None) -> tuple[int, int]:
    """The largest MLA latent the target engine serves that is smaller than the source's K+V."""
    from kvconvert.checkpoint import read_config
    from kvconvert.mla.deepseek_format import head_dim
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


def _from_recipe(recipe_file: Path, src: str, out_dir: Path):
    from kvconvert.recipe import load_recipe

    ctx = click.get_current_context()
    given = [name for name in RECIPE_OWNS
             if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise KVConvertError(f"{flags}: set by the recipe ({recipe_file}); change the recipe instead")
    recipe = load_recipe(recipe_file)
    if recipe.source and ctx.get_parameter_source("src") == click.core.ParameterSource.COMMANDLINE and src != recipe.source:
        raise KVConvertError(f"--src {src}: the recipe's source is {recipe.source}; drop --src or edit the recipe")
    src = recipe.source or src
    stages, kv_dtype, policy_file = recipe_stages(recipe, recipe_file, src, out_dir)
    val = recipe.validate_
    suite = val.suite if val is not None else "quick"
    engine = val.engine if val is not None else "auto"
    return stages, kv_dtype, policy_file, suite, engine, src
