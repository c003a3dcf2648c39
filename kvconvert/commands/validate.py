"""`kvconvert validate` (kvconvert.eval.validate) and `kvconvert gate` (kvconvert.eval.gate)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvconvert.commands.options import click_options, no_progress_option, out_option, threads_option
from kvconvert.eval.options import ValidateOptions
from kvconvert.stage_options import build_options


@click.command("validate")
@click.option("--source", required=True, help="Source model: HF folder or built-in name (smollm2-135m).")
@click.option("--candidate", required=True, help="Candidate model folder (converted / calibrated).")
@click_options(ValidateOptions)
@click.option("--vllm-python", type=click.Path(dir_okay=False), default=None,
              help="--engine vllm: the python that has vllm "
                   "(default $KVCONVERT_VLLM_PYTHON, else ./.venv-vllm/bin/python).")
@out_option("Report folder (report.json, report.md, PNGs, cache/). Reusing it resumes.")
@click.option("--no-resume", is_flag=True, help="Recompute every sample instead of reusing cached results.")
@no_progress_option
@threads_option
def validate_cmd(source, candidate, vllm_python, out, no_resume, no_progress, threads, **params):
    """Run SOURCE and CANDIDATE on identical inputs; write a report with per-metric deltas.

    Perplexity and token KL on the essays, passkey, NIAH, RULER-style tasks and LongBench-mini,
    as the suite defines. Gate the result with `kvconvert gate --report OUT/report.json`.
    """
    from kvconvert.eval.report import print_summary
    from kvconvert.eval.cache import source_results_dir
    from kvconvert.eval.validate import run_validate

    opts = build_options(ValidateOptions, params)
    report = run_validate(source, candidate, out, opts, resume=not no_resume, progress=not no_progress,
                          threads=threads, vllm_python=vllm_python, shared=source_results_dir())
    print_summary(report)
    if opts.engine == "vllm":
        from kvconvert.eval.report import markdown_section

        click.echo("\n".join(markdown_section(report)).strip())
    if opts.engine == "llamacpp":
        from kvconvert.eval.report import llamacpp_section

        click.echo("\n".join(llamacpp_section(report)).strip())
    click.echo(f"report: {out / 'report.json'} and {out / 'report.md'}")


@click.command("gate")
@click.option("--report", "report_path", required=True, type=click.Path(path_type=Path),
              help="report.json from kvconvert validate (or its folder).")
@click.option("--policy", "policy_path", required=True, type=click.Path(path_type=Path),
              help="Policy YAML, e.g. recipes/gates/default.yaml.")
def gate_cmd(report_path, policy_path):
    """Exit 0 when the REPORT passes the POLICY, 1 when a metric blocks.

    Each metric is PASS (its bootstrap interval wholly within the threshold), FAIL (wholly past it)
    or INCONCLUSIVE (straddling it; the policy's on_inconclusive says whether that blocks).
    """
    from kvconvert.eval.gate import run_gate

    if not run_gate(report_path, policy_path):
        sys.exit(1)
