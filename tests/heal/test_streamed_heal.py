"""Distillation on streamed shards (kvconvert.token_stream): a `kvconvert heal` killed with SIGKILL at a
random step and rerun ends with the uninterrupted run's weights bit for bit, because the data position
(the block state and the next window) is saved with the trainable tensors and the optimizer; a mix of
shard folders and a datasets-streamed file heals too; the history records how long training waited
for data."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from heal_cases import distill_recipe

from kvconvert.checkpoint import CheckpointReader
from kvconvert.heal.api import state_dir_for

STEPS = 12
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _recipe_file(folder: Path, data, tmp_path: Path) -> Path:
    # block 1024 windows > the 24 this run reads: one permutation of the run's windows; seq 128
    recipe = distill_recipe(Path("x"), data=data, tokens=STEPS * 2 * 128, checkpoint_every=1, seed=5)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _command(student, teacher, recipe: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "kvconvert.cli", "heal", "--student", str(student), "--teacher", str(teacher),
            "--recipe", str(recipe), "--out", str(out), "--no-progress", "--threads", "1"]


def _saved_step(state: Path) -> int:
    try:
        return int(torch.load(state, map_location="cpu", weights_only=True)["step"])
    except (FileNotFoundError, EOFError, RuntimeError):  # not written yet (or replaced while read)
        return 0


def _weights(out: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(out)
    return {name: reader.get(name) for name in reader.keys()}


def test_killed_at_a_random_step_and_resumed_is_bit_identical(tiny_student, tiny_teacher, shard_folder, tmp_path):
    recipe = _recipe_file(shard_folder, str(shard_folder), tmp_path)
    full = tmp_path / "full"
    done = subprocess.run(_command(tiny_student, tiny_teacher, recipe, full), capture_output=True, text=True,
                          env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    kill_at = random.Random(time.time_ns()).randint(2, STEPS - 2)
    part = tmp_path / "part"
    state = state_dir_for(part) / "distill" / "distill_state.pt"
    proc = subprocess.Popen(_command(tiny_student, tiny_teacher, recipe, part), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.time() + 600
        while _saved_step(state) < kill_at and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # no handler runs: only what was saved survives
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = _saved_step(state)
    assert proc.returncode == -signal.SIGKILL and kill_at <= killed_at < STEPS, (kill_at, killed_at, proc.stderr.read())
    assert not part.exists()

    done = subprocess.run(_command(tiny_student, tiny_teacher, recipe, part), capture_output=True, text=True,
                          env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((part / "heal_report.json").read_text())["stages"]["heal_distill"]
    assert report["resumed_at_step"] == killed_at and report["steps_done"] == STEPS
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys()
    changed = [n for n in a if not torch.equal(a[n], b[n])]
    assert not changed, f"killed at step {killed_at}: {changed[:3]}"
    hist = [[json.loads(x)["loss"] for x in (o / "distill_history.jsonl").read_text().splitlines()] for o in (full, part)]
    assert hist[0] == hist[1]


def test_a_weighted_mix_with_datasets_streaming_heals(tiny_student, tiny_teacher, shard_folder, text_file, tmp_path):
    pytest.importorskip("datasets")
    from kvconvert.recipe import heal

    mix = {str(shard_folder): 0.7, f"hf:{shard_folder / 'part-0.jsonl'}": 0.3}
    out = tmp_path / "mixed"
    report = heal(tiny_student, tiny_teacher, distill_recipe(text_file, data=mix, tokens=4 * 2 * 128,
                                                             checkpoint_every=0), out, progress=False)
    d = report["stages"]["heal_distill"]
    assert d["finished"] and d["steps_done"] == 4 and 0 <= d["data_wait_share"] < 1
    sources = report["data"]["distill"]["stream"]["sources"]
    assert [s["weight"] for s in sources] == [0.7, 0.3] and sources[1]["datasets"] is True
    history = [json.loads(x) for x in (out / "distill_history.jsonl").read_text().splitlines()]
    assert all(r["data_wait_s"] >= 0 for r in history)
