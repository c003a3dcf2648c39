"""The 7B recipe's distillation memory on a CPU: a Llama-2-7B-shaped pair (kvconvert.presets' shapes, 2 of 32 layers, random
weights written as safetensors) and its MLA 512 + 64 student distil for 1 + 1 steps of the real loop with
recipes/llama-2-7b-mla512.yaml's heal_distill switches (bf16, no gradient checkpointing since frozen
weights are held in bf16, every attention weight trained, fused Adam), in a fresh process whose peak RSS is checked against the estimate the
recipe's 80 GB design rests on. ~5 GB of RAM; the same step runs at 32 layers on a GPU
(scripts/gpu_session.sh heal7b)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_7b_shaped_heal_steps_fit_their_estimate(tmp_path):
    from kvconvert.recipe import load_recipe

    d = load_recipe(ROOT / "recipes" / "llama-2-7b-mla512.yaml").distill
    switches = {k: getattr(d, k) for k in ("gradient_checkpointing", "fused_optimizer", "targets", "train")}
    out = tmp_path / "7b.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_distill.py"), "--device", "cpu", "--preset", "llama-2-7b",
         "--layers", "2", "--rank", "512", "--rope-dim", "64", "--save-dtype", "bfloat16", "--variants", "b1s64",
         "--mixed-precision", d.mixed_precision, "--warmup", "1", "--steps", "1", "--stage", json.dumps(switches),
         "--json", str(out), "--md", str(tmp_path / "7b.md")], capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["ckpt"] == d.gradient_checkpointing and math.isfinite(row["loss_last"])
    assert row["peak_gb"] > 4  # 2 layers of 7B width, a 32K vocabulary: the weights alone are ~4 GB
    assert 1.0 <= row["est_over_measured"] <= 1.3, row
