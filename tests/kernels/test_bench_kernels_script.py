"""scripts/bench_kernels.py --cpu-smoke runs its whole plumbing (checks against the references, tuning,
every cache mode and dot variant of both kernels, JSON and markdown) in the Triton interpreter. It is
started without TRITON_INTERPRET, as its docstring says to: the script has to pick the interpreter
itself (it failed to, unnoticed, until session 18)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvconvert.kernels.cache_layout import GQA_MODES, MLA_MODES

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


@pytest.mark.slow
def test_bench_kernels_cpu_smoke_covers_every_mode(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    result = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--json", str(out_json), "--md", str(out_md)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    for kernel, modes in (("mla", MLA_MODES), ("gqa", GQA_MODES)):
        rows = {(r["impl"], r["mode"]) for r in report[kernel]}
        assert {("triton", m) for m in modes} | {("triton-fp8dot", "fp8")} <= rows, rows
        assert all(r["time_us"] > 0 for r in report[kernel])
    assert "### MLA" in out_md.read_text() and "### GQA" in out_md.read_text()
