"""scripts/bench_distill.py --smoke: the distillation benchmark's plumbing on CPU (random 2-layer
SmolLM2-shaped teacher and its MLA student saved as safetensors, the real Distiller in a fresh process,
timed steps, measured peak beside the estimate, JSON and markdown). The speeds are only meaningful on a
GPU; the estimate against the measured peak is test_distill_memory_measured.py's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_distill.py"


@pytest.mark.slow
def test_bench_distill_smoke(tmp_path):
    out_json, out_md = tmp_path / "d.json", tmp_path / "d.md"
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out_json), "--md", str(out_md)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out_json.read_text())
    (row,) = report["rows"]
    assert (row["batch"], row["seq_len"], row["compile"]) == (2, 64, False)
    assert row["tokens_per_s"] > 0 and math.isfinite(row["loss_first"]) and math.isfinite(row["loss_last"])
    assert row["peak_gb"] > 0 and row["estimate_gb"] > 0 and row["est_over_measured"] > 0  # issue 38's columns
    assert "| 2 | 64 | no |" in out_md.read_text()


def test_bench_distill_rejects_a_malformed_variant():
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--variants", "8x2048"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "bad variant '8x2048'" in result.stderr
