"""Multi-process distillation: two processes (CPU, gloo) follow the same loss trajectory and end at
the same weights as one process with the same global batch.

The processes are started by torchrun (it ships with torch): on a CPU, `accelerate launch --cpu
--num_processes 2` starts a single process (accelerate's multi-CPU launch needs MPI), while the
distiller's Accelerator(cpu=True) joins a torchrun group as MULTI_CPU with gloo. On GPUs, `accelerate
launch --multi_gpu` starts the same code (docs/heal.md).

One process: batch 1 x grad_accum 2; two processes: batch 1 x grad_accum 1 each. The distiller hands
global micro-batch g = (step * grad_accum + micro) * world + rank to each process, so both runs see
the same two sequences per step, and DDP's gradient mean equals grad_accum's mean."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from heal_cases import distill_recipe

from kvconvert.checkpoint import CheckpointReader

STEPS, SEQ = 4, 128


def _recipe(folder: Path, text_file: Path, grad_accum: int) -> Path:
    """STEPS steps of 2 sequences in total: `tokens` counts all processes together."""
    stage = distill_recipe(text_file, tokens=STEPS * 2 * SEQ, batch_size=1, grad_accum=grad_accum,
                           checkpoint_every=0, warmup_steps=1)
    path = folder / f"distill-ga{grad_accum}.yaml"
    path.write_text(yaml.safe_dump(stage))
    return path


def _heal(launcher: list[str], student, teacher, recipe, out: Path) -> tuple[list[dict], dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [*launcher, "kvconvert.cli", "heal", "--student", str(student), "--teacher", str(teacher),
           "--recipe", str(recipe), "--out", str(out), "--no-progress", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    history = [json.loads(line) for line in (out / "distill_history.jsonl").read_text().splitlines()]
    reader = CheckpointReader(out)
    return history, {name: reader.get(name) for name in reader.keys()}


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(tiny_student, tiny_teacher, text_file, tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None, "torchrun ships with torch"
    one, w1 = _heal([sys.executable, "-m"], tiny_student, tiny_teacher, _recipe(tmp_path, text_file, 2),
                    tmp_path / "one")
    two, w2 = _heal([torchrun, "--standalone", "--nproc_per_node", "2", "-m"],
                    tiny_student, tiny_teacher, _recipe(tmp_path, text_file, 1), tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert [r["tokens"] for r in one] == [r["tokens"] for r in two]  # same global batch per step
    for a, b in zip(one, two):  # the logged loss is the mean over all processes' sequences
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]  # it trained
    changed = [n for n in w1 if "self_attn" in n]
    assert changed and w1.keys() == w2.keys()
    for name in changed:
        torch.testing.assert_close(w2[name].float(), w1[name].float(), rtol=1e-3, atol=1e-5, msg=name)
