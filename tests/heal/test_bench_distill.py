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
    assert row["peak_gb"] > 0 and row["estimate_gb"] > 0 and row["est_over_measured"] > 0  # the memory columns
    assert "| 2 | 64 | no |" in out_md.read_text()


def test_bench_distill_rejects_a_malformed_variant():
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--variants", "8x2048"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "bad variant '8x2048'" in result.stderr


def _load_script():
    import importlib.util

    sys.path.insert(0, str(SCRIPT.parent))  # bench_common beside it
    spec = importlib.util.spec_from_file_location("bench_distill_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_allocations_replays_an_allocator_trace():
    """--memory-trace's replay: the peak is the largest sum of live blocks, and the blocks live at that
    moment (not those allocated and freed before or after it) are grouped by the library line."""
    bench = _load_script()
    here = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": "/x/transformers/models/llama/modeling_llama.py", "line": 42, "name": "forward"}]
    loss = [{"filename": "/site/kvconvert/heal/fused_loss.py", "line": 7, "name": "forward"}]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": here},
        {"action": "alloc", "addr": 2, "size": 50, "frames": loss},
        {"action": "free_requested", "addr": 2, "size": 50, "frames": loss},
        {"action": "free_completed", "addr": 2, "size": 50, "frames": loss},
        {"action": "alloc", "addr": 3, "size": 70, "frames": []},
        {"action": "alloc", "addr": 4, "size": 30, "frames": loss},  # the peak: 100 + 70 + 30
        {"action": "free_completed", "addr": 1, "size": 100, "frames": here},
        {"action": "alloc", "addr": 5, "size": 100, "frames": here},  # 200 again, not more: the first peak stays
    ]
    peak, groups = bench.peak_allocations(events)
    assert peak == 200
    assert groups == {"llama/modeling_llama.py:42 forward": [100, 1], "heal/fused_loss.py:7 forward": [30, 1],
                      "<no library frame: autograd backward or torch internals>": [70, 1]}
