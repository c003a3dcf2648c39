"""scripts/bench_kernels.py: the short run's plan and report plumbing (fast, no kernels), and --cpu-smoke, which
runs the whole script (checks against the references, every cache mode and dot variant of both kernels, the
peers' rows, JSON and markdown) in the Triton interpreter, for the short run and the tuning sweep. The smoke is
started without TRITON_INTERPRET, as its docstring says to: the script has to pick the interpreter itself (a
script that does not would go unnoticed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvconvert.kernels.cache_layout import GQA_MODES, MLA_MODES

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))  # its own imports (bench_common)
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kernel, modes", [("mla", MLA_MODES), ("gqa", GQA_MODES)])
def test_short_plan_covers_every_mode_with_the_tuned_configs(bench, kernel, modes):
    """Every cache mode with the default dots, every quantized mode with fp16 dots, fp8 with fp8 dots, at the
    configs the tuning runs found (the short run reproduces the tuned numbers), plus the candidates."""
    plan = bench.short_plan(kernel)
    rows = {(impl, mode) for impl, mode, _, _ in plan}
    assert {("triton", m) for m in modes} | {("triton-fp16dot", m) for m in modes if m != "none"} <= rows
    assert ("triton-fp8dot", "fp8") in rows
    for impl, mode, dot, cfg in plan:
        tuned = bench.TUNED.get((kernel, mode, dot)) or bench.TUNED[(kernel, mode, None)]
        if impl.startswith("triton-") and impl not in ("triton-fp16dot", "triton-fp8dot"):
            continue  # a candidate: its own options over the tuned config
        assert cfg == tuned, (impl, mode, cfg)
    assert bench.TUNED[("mla", "none", None)] == {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2}
    assert bench.TUNED[("gqa", "fp8", None)] == {"block_h": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}


def test_report_rows_get_ratios_and_the_table_shows_them(bench):
    def row(impl, mode, context, us, bytes_per_token, error=None):
        gbps = None if us is None else 8 * context * bytes_per_token / (us * 1e-6) / 1e9
        return {"impl": impl, "mode": mode, "batch": 8, "context": context, "bytes_per_token": bytes_per_token,
                "time_us": us, "kv_GBps": gbps, "frac_of_peak": None, "config": {"block_h": 16}, "error": error,
                "eager_us": None, "unfused_us": None}

    rows = [row("triton", "none", 32768, 150.0, 1152), row("triton", "fp8", 32768, 75.0, 576),
            row("flashinfer", "none", 32768, None, 1152, error="not importable: ModuleNotFoundError")]
    bench.add_ratios(rows, copy_GBps=2400.0)
    assert rows[0]["speed_vs_bf16"] == 1.0 and rows[1]["speed_vs_bf16"] == 2.0 and rows[2]["speed_vs_bf16"] is None
    assert rows[0]["frac_of_copy"] == pytest.approx(8 * 32768 * 1152 / 150e-6 / 1e9 / 2400)
    report = {"device": "test", "peak_bandwidth_GBps": 3350.0, "copy_bandwidth_GBps": 2400.0, "batch": 8,
              "block_size": 64, "mla_heads": 16, "checks": [{"ok": True}], "mla": rows, "run": "short"}
    md = bench.markdown(report)
    assert "| triton | fp8 | 576 | 32768 | 75.0 | 2.00x |" in md
    assert "error: not importable: ModuleNotFoundError" in md and "measured copy: 2400 GB/s" in md


def test_default_is_the_short_run(bench):
    args = bench.parse_args([])
    assert not args.tune and not args.quick and bench.SHORT_CONTEXTS == "8192,32768"


@pytest.mark.slow
# the sweep's smoke tunes MLA only (--skip-gqa): GQA's tuning runs the same bench_kernel code, and the short run
# covers both kernels' modes
@pytest.mark.parametrize("extra", [[], ["--quick", "--skip-gqa"]], ids=["short", "sweep"])
def test_bench_kernels_cpu_smoke_covers_every_mode(tmp_path, extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    result = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", *extra, "--json", str(out_json),
                             "--md", str(out_md)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    for kernel, modes in (("mla", MLA_MODES), ("gqa", GQA_MODES))[:1 if extra else 2]:
        rows = {(r["impl"], r["mode"]) for r in report[kernel]}
        assert {("triton", m) for m in modes} | {("triton-fp8dot", "fp8")} <= rows, rows
        assert all(r["time_us"] > 0 and r["speed_vs_bf16"] > 0 for r in report[kernel] if r["impl"].startswith("triton"))
    if not extra:  # the short run records a peer that cannot run (not installed here) as a row
        assert any(r["impl"] == "flashinfer" and r["error"] for r in report["gqa"])
    assert "### MLA" in out_md.read_text() and ("### GQA" in out_md.read_text()) == (not extra)
