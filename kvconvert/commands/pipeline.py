"""`kvconvert pipeline`: the whole job on one model (kvconvert.pipeline): convert to MLA (-> heal) ->
calibrate KV scales -> validate against the source -> gate, ending with the report table."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from click.core import ParameterSource

from kvconvert.commands.options import click_options
from kvconvert.pipeline import PipelineOptions, run_pipeline
from kvconvert.sources import DEFAULT_MODEL
from kvconvert.stage_options import build_options


@click.command("pipeline")
@click.option("--src", default=DEFAULT_MODEL, show_default=True, help="Source model (folder, built-in name, hub id).")
@click.option("--recipe", "recipe_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Recipe YAML whose blocks drive every stage (its `source` replaces --src when set).")
@click_options(PipelineOptions)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True)
@click.option("--overwrite", is_flag=True, help="Recompute every stage (default: reuse finished stages).")
@click.option("--fail-on-gate", is_flag=True, help="Exit 1 when the gate fails (for CI); default: report and exit 0.")
@click.pass_context
def pipeline_cmd(ctx, src, recipe_file, out_dir, overwrite, fail_on_gate, **params):
    """Convert -> heal -> calibrate -> validate -> gate, ending with the report table."""
    t0 = time.time()  # Total counts all this command runs, the plan of --kv-budget included
    given = frozenset(name for name in ctx.params if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE)
    opts = build_options(PipelineOptions, params)
    run = run_pipeline(src, recipe_file, opts, out_dir, overwrite=overwrite, given=given, echo=_echo)
    report_dir, log = out_dir / "report", run["log"]
    candidate = next((s.out for s in reversed(run["stages"]) if s.out), run["src"])
    pictures = sorted(p.name for p in report_dir.glob("*.png"))
    click.echo(f"\nReport: {report_dir / 'report.md'}\nPictures: {', '.join(pictures) or 'none'} in {report_dir}"
               f"\nValidated model: {candidate}\nTotal: {time.time() - t0:.0f} s"
               + (f" (the plan {run['planned']:.0f} s, then the stages)" if opts.kv_budget is not None else ""))
    gate_ok = log[-1]["exit_code"] == 0
    policy = Path(run["stages"][-1].argv[-1]).name  # the gate's argv ends: --policy FILE
    click.secho(f"Gate ({policy}): {'PASS' if gate_ok else 'FAIL'}", fg="green" if gate_ok else "red")
    if not gate_ok and fail_on_gate:
        sys.exit(log[-1]["exit_code"])


def _echo(msg: str, color: str | None = None) -> None:
    """The pipeline's progress lines on stderr, stage headers in colour on a terminal."""
    click.secho(msg, fg=color, err=True)
