"""Click commands `kvconvert validate` and `kvconvert gate` (loaded lazily by kvconvert.cli)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvconvert.eval.runner import KV_DTYPE_CHOICES
from kvconvert.eval.suites import SUITES


@click.command("validate")
@click.option("--source", required=True, help="Source model: HF folder or built-in name (smollm2-135m).")
@click.option("--candidate", required=True, help="Candidate model folder (converted / calibrated).")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPE_CHOICES), default="auto", show_default=True,
              help="Candidate's KV-cache format (auto = the engine's unquantized cache: runtime bf16, transformers fp32).")
@click.option("--source-kv-dtype", type=click.Choice(KV_DTYPE_CHOICES), default="auto", show_default=True,
              help="Source's KV-cache format.")
@click.option("--kv-scales", type=click.Choice(["checkpoint", "dynamic"]), default="checkpoint", show_default=True,
              help="Runtime engine: fp8/nvfp4 scales from the checkpoint or from the first prefill.")
@click.option("--engine", type=click.Choice(["auto", "runtime", "transformers", "vllm"]), default="auto",
              show_default=True,
              help="auto = the bundled runtime when it imports, else transformers (with a note). vllm = the suite in "
                   "the bundled runtime, plus perplexity and KL computed by stock vLLM on the same windows, side by "
                   "side in the report (vLLM from ./.venv-vllm: bash scripts/setup_vllm.sh).")
@click.option("--vllm-python", type=click.Path(dir_okay=False), default=None,
              help="--engine vllm: the python that has vllm "
                   "(default $KVCONVERT_VLLM_PYTHON, else ./.venv-vllm/bin/python).")
@click.option("--suite", type=click.Choice(list(SUITES)), default="quick", show_default=True,
              help="smoke (tests) < quick (< 5 min on CPU) < standard (~30 min) < full (GPU).")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Report folder (report.json, report.md, PNGs, cache/). Reusing it resumes.")
@click.option("--longbench-dir", type=click.Path(path_type=Path), default=None,
              help="LongBench-mini folder (default: $KVCONVERT_LONGBENCH_DIR or shared/data/longbench-mini).")
@click.option("--no-resume", is_flag=True, help="Recompute every sample instead of reusing cached results.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("--dtype", type=click.Choice(["auto", "bf16", "fp16", "fp32"]), default="auto", show_default=True,
              help="Both models' weights/activations: auto = as stored (bf16 checkpoints run in bf16).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch CPU threads (default: torch's choice; 1 is faster on a CPU shared with other jobs).")
def validate_cmd(source, candidate, kv_dtype, source_kv_dtype, kv_scales, engine, vllm_python, suite, out,
                 longbench_dir, no_resume, no_progress, dtype, threads):
    """Run SOURCE and CANDIDATE on identical inputs; write a report with per-metric deltas.

    Perplexity and token KL on the essays, passkey, NIAH, RULER-style tasks and LongBench-mini,
    as the suite defines. Gate the result with `kvconvert gate --report OUT/report.json`.
    """
    from kvconvert.eval.report import print_summary
    from kvconvert.eval.validate import ValidateOptions, run_validate

    with_vllm = engine == "vllm"
    if with_vllm:  # fail before hours of suite work when vLLM is not there
        from kvconvert.eval.engine_vllm import check_vllm, vllm_kv_dtype

        check_vllm(vllm_python)
        vllm_kv_dtype(kv_dtype, "candidate")
        vllm_kv_dtype(source_kv_dtype, "source")
    elif vllm_python:
        raise click.UsageError("--vllm-python goes with --engine vllm")
    opts = ValidateOptions(source=source, candidate=candidate, out=out, suite=suite,
                           engine="auto" if with_vllm else engine, kv_dtype=kv_dtype,
                           source_kv_dtype=source_kv_dtype, kv_scales=kv_scales, longbench_dir=longbench_dir,
                           resume=not no_resume, progress=not no_progress, threads=threads, dtype=dtype)
    _preflight(source, candidate, out)
    report = run_validate(opts)
    if with_vllm:
        from kvconvert.eval.engine_vllm import markdown_section, run_vllm_perplexity, write_with_vllm

        run_vllm_perplexity(opts, report, vllm_python)
        write_with_vllm(report, out)
    print_summary(report)
    if with_vllm:
        click.echo("\n".join(markdown_section(report)).strip())
    click.echo(f"report: {out / 'report.json'} and {out / 'report.md'}")


def _preflight(source: str, candidate: str, out: Path) -> None:
    """Up-front checks (kvconvert.checkpoint): --out writable, both models supported and intact."""
    from kvconvert.checkpoint import check_checkpoint, check_writable
    from kvconvert.sources import resolve_source

    check_writable(out)
    for model in (source, candidate):
        check_checkpoint(resolve_source(model))


@click.command("gate")
@click.option("--report", "report_path", required=True, type=click.Path(path_type=Path),
              help="report.json from kvconvert validate (or its folder).")
@click.option("--policy", "policy_path", required=True, type=click.Path(path_type=Path),
              help="Policy YAML, e.g. recipes/gates/default.yaml.")
def gate_cmd(report_path, policy_path):
    """Exit 0 when every threshold of the POLICY holds for the REPORT, 1 when one fails.

    Degradations are compared on the policy's bootstrap interval bound (decide_on), so noise on
    small sample counts alone does not fail the gate.
    """
    from kvconvert.eval.gate import evaluate, load_policy, load_report, print_gate_table

    policy = load_policy(policy_path)
    report = load_report(report_path)
    rows = evaluate(report, policy)
    print_gate_table(rows, policy, report, Path(policy_path))
    failed = [r["metric"] for r in rows if r["status"] == "fail"]
    if failed:
        click.echo(f"gate FAILED: {', '.join(failed)}")
        sys.exit(1)
    click.echo("gate passed")
