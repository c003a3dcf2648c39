"""`kvconvert pipeline`: the whole job on one model, as the CLI commands a user would run:
convert to MLA (-> heal) -> calibrate KV scales -> validate against the source -> gate.

Each stage runs as its own `kvconvert ...` process and is printed first, so the pipeline doubles as
documentation of the individual commands. A stage whose output already exists is reused when
--resume is given (the default), so an interrupted pipeline continues where it stopped.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import click

from kvconvert.errors import KVConvertError

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


def _policy_path(policy: str) -> str:
    path = Path(policy)
    if path.is_file():
        return str(path)
    candidate = REPO_GATES / f"{policy}.yaml"
    if candidate.is_file():
        return str(candidate)
    raise KVConvertError(f"--policy {policy}: not a file and not a built-in policy in {REPO_GATES}")


@click.command("pipeline")
@click.option("--src", default="smollm2-135m", show_default=True, help="Source model (folder, built-in name, hub id).")
@click.option("--rank", type=int, default=96, show_default=True, help="kv_lora_rank of the MLA conversion.")
@click.option("--rope-dim", type=int, default=32, show_default=True)
@click.option("--heal", default="layerwise", show_default=True, help="none, layerwise or a recipe YAML.")
@click.option("--calib-tokens", type=click.IntRange(min=512), default=None,
              help="Calibration tokens for both convert and calibrate (default: each command's own default).")
@click.option("--kv-dtype", type=click.Choice(["fp8", "nvfp4", "bf16"]), default="fp8", show_default=True)
@click.option("--suite", default="quick", show_default=True)
@click.option("--policy", default="default", show_default=True, help="Gate policy: a YAML file or a built-in name.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True)
@click.option("--overwrite", is_flag=True, help="Recompute every stage (default: reuse finished stages).")
@click.option("--fail-on-gate", is_flag=True, help="Exit 1 when the gate fails (for CI); default: report and exit 0.")
def pipeline_cmd(src, rank, rope_dim, heal, calib_tokens, kv_dtype, suite, policy, out_dir, overwrite, fail_on_gate):
    """Convert -> heal -> calibrate -> validate -> gate, ending with the report table."""
    import json

    policy_file = _policy_path(policy)
    out_dir.mkdir(parents=True, exist_ok=True)
    mla_dir, cal_dir, report_dir = out_dir / "mla", out_dir / f"mla-{kv_dtype}", out_dir / "report"
    log: list = []
    calib = [] if calib_tokens is None else ["--calib-tokens", str(calib_tokens)]
    t0 = time.time()
    if overwrite or not _done(mla_dir, "manifest.json"):
        _run("convert", ["mla", "--src", src, "--rank", str(rank), "--rope-dim", str(rope_dim), "--heal", heal,
                         *calib, "--out", str(mla_dir), "--overwrite"], log)
    candidate = mla_dir
    if kv_dtype != "bf16":
        if overwrite or not _done(cal_dir, "manifest.json"):
            _run("calibrate", ["calibrate", "--src", str(mla_dir), "--kv-dtype", kv_dtype, *calib,
                               "--out", str(cal_dir), "--overwrite"], log)
        candidate = cal_dir
    _run("validate", ["validate", "--source", src, "--candidate", str(candidate), "--kv-dtype", kv_dtype,
                      "--suite", suite, "--out", str(report_dir)], log)
    _run("gate", ["gate", "--report", str(report_dir / "report.json"), "--policy", policy_file], log)
    (out_dir / "pipeline.json").write_text(json.dumps({"stages": log, "seconds": round(time.time() - t0, 1)}, indent=2))
    pictures = sorted(p.name for p in report_dir.glob("*.png"))
    click.echo(f"\nReport: {report_dir / 'report.md'}\nPictures: {', '.join(pictures) or 'none'} in {report_dir}"
               f"\nConverted model: {mla_dir}  (+ KV scales: {candidate})\nTotal: {time.time() - t0:.0f} s")
    gate_ok = log[-1]["exit_code"] == 0
    click.secho(f"Gate ({Path(policy_file).name}): {'PASS' if gate_ok else 'FAIL'}", fg="green" if gate_ok else "red")
    if not gate_ok and fail_on_gate:
        sys.exit(log[-1]["exit_code"])
