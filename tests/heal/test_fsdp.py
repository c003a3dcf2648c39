"""FSDP distillation: two CPU processes (gloo), started by `accelerate launch` with the shipped
recipes/accelerate/fsdp.yaml, shard the student and the teacher (each process holds half of each
one's parameter bytes) and log the same loss at every step as one process with the same global
batch; interrupted and resumed under FSDP (a slow test), they end at the same healed weights.

One process: batch 2 x grad_accum 2. Two processes: batch 1 x grad_accum 2 each. The distiller hands
global micro-batch g = (step * grad_accum + micro) * world + rank to each process, so both runs see
the same four sequences per step; FSDP's reduce-scatter means the two processes' gradients (fp32),
as the single process's gradient accumulation does. Tolerance: rel 1e-5 on each step's loss (fp32
sums in another order; measured 6e-8), rel 1e-4 on the weights after 4 Adam steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from heal_cases import distill_recipe

from kvconvert.checkpoint import CheckpointReader
from kvconvert.heal.api import state_dir_for
from kvconvert.recipe import heal
from kvconvert.resources import recipes_dir

STEPS, SEQ = 4, 128
FSDP_CONFIG = recipes_dir() / "accelerate" / "fsdp.yaml"


def _recipe(text_file: Path, batch_size: int) -> dict:
    """STEPS steps of 4 sequences in total (`tokens` counts all processes together)."""
    return distill_recipe(text_file, tokens=STEPS * 4 * SEQ, batch_size=batch_size, grad_accum=2,
                          checkpoint_every=0, warmup_steps=1)


def _launch(student, teacher, recipe: Path, out: Path, *extra: str) -> None:
    """`accelerate launch --config_file fsdp.yaml` of `kvconvert heal` as a user types it; the
    config's main_process_port 0 takes a free port (torchrun's rendezvous on 127.0.0.1)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG),
           "--num_processes", "2", "-m", "kvconvert.cli", "heal", "--student", str(student), "--teacher",
           str(teacher), "--recipe", str(recipe), "--out", str(out), "--no-progress", "--threads", "1", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(out)
    return {name: reader.get(name) for name in reader.keys() if "self_attn" in name}


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "distill_history.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tiny_student, tiny_teacher, text_file, tmp_path_factory) -> Path:
    """The reference: one process, batch 2 x grad_accum 2, uninterrupted."""
    out = tmp_path_factory.mktemp("fsdp") / "one"
    heal(tiny_student, tiny_teacher, _recipe(text_file, batch_size=2), out, progress=False)
    return out


def _fsdp_recipe(text_file: Path, folder: Path) -> Path:
    path = folder / "fsdp-recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(text_file, batch_size=1)))
    return path


def _assert_same_run(one: Path, two: Path) -> None:
    """Same global batch per step, same logged loss and gradient norm per step, same healed weights."""
    h1, h2 = _history(one), _history(two)
    assert [r["step"] for r in h1] == [r["step"] for r in h2] == list(range(1, STEPS + 1))
    assert [r["tokens"] for r in h1] == [r["tokens"] for r in h2]
    for a, b in zip(h1, h2):  # logged loss: the mean over both processes' sequences
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)
    assert h1[-1]["loss"] < h1[0]["loss"]  # it trained
    w1, w2 = _weights(one), _weights(two)
    assert w1 and w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name].float(), w1[name].float(), rtol=1e-4, atol=1e-6, msg=name)


def test_fsdp_two_processes_shard_the_student_and_match_one(one_process, tiny_student, tiny_teacher, text_file,
                                                            tmp_path):
    assert FSDP_CONFIG.is_file()
    two = tmp_path / "two"
    _launch(tiny_student, tiny_teacher, _fsdp_recipe(text_file, tmp_path), two)
    shards = json.loads((two / "heal_report.json").read_text())["stages"]["heal_distill"]["sharding"]
    assert shards["processes"] == 2 and shards["fsdp"] is True
    for model in ("student", "teacher"):  # the frozen teacher is sharded too
        per_rank, whole = shards[f"{model}_bytes_per_process"], shards[f"{model}_bytes"]
        assert len(per_rank) == 2 and sum(per_rank) == whole  # dim-0 shards: nothing held twice
        assert all(0.45 * whole <= b <= 0.55 * whole for b in per_rank), (model, shards)
    _assert_same_run(one_process, two)


@pytest.mark.slow
def test_fsdp_interrupted_and_resumed_matches_one(one_process, tiny_student, tiny_teacher, text_file, tmp_path):
    """Stopped after 2 of 4 steps (trainable tensors and Adam state gathered whole into the state
    area), then resumed by the same command: the same run as the uninterrupted single process."""
    two, recipe = tmp_path / "two", _fsdp_recipe(text_file, tmp_path)
    _launch(tiny_student, tiny_teacher, recipe, two, "--max-steps", "2")
    assert not two.exists() and (state_dir_for(two) / "distill" / "distill_state.pt").is_file()
    _launch(tiny_student, tiny_teacher, recipe, two)
    assert json.loads((two / "heal_report.json").read_text())["stages"]["heal_distill"]["resumed_at_step"] == 2
    _assert_same_run(one_process, two)


@pytest.mark.slow
def test_fsdp1_config_is_refused_before_training(tiny_student, tiny_teacher, text_file, tmp_path):
    """FSDP1 (flat parameters) does not fit the attention-only trainable set: a clear error, exit 2,
    before any model is loaded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG), "--fsdp_version",
           "1", "--num_processes", "2", "-m", "kvconvert.cli", "heal", "--student", str(tiny_student), "--teacher",
           str(tiny_teacher), "--recipe", str(_fsdp_recipe(text_file, tmp_path)), "--out", str(tmp_path / "out"),
           "--no-progress", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert "needs fsdp_version: 2" in proc.stderr and not (tmp_path / "out").exists()


def test_fsdp_two_processes_on_streamed_shards_match_one(tiny_student, tiny_teacher, shard_folder, tmp_path):
    """The data streamed from a folder of .jsonl and .parquet shards (kvconvert.token_stream): each process
    tokenizes on its own background thread and takes its own micro-batches of the one window sequence,
    so the two FSDP processes still log one process's loss at every step and end at its weights."""
    one, two = tmp_path / "one", tmp_path / "two"
    heal(tiny_student, tiny_teacher, _recipe(shard_folder, batch_size=2), one, progress=False)
    _launch(tiny_student, tiny_teacher, _fsdp_recipe(shard_folder, tmp_path), two)
    report = json.loads((two / "heal_report.json").read_text())
    assert report["stages"]["heal_distill"]["sharding"]["fsdp"] is True
    assert report["data"]["distill"]["stream"]["sources"][0]["files"] == 4
    _assert_same_run(one, two)


def _one_process_group(rendezvous: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)


def test_heal_command_destroys_the_process_group_it_ran_under(tmp_path):
    """A launched heal that returned destroys its process group (left to interpreter exit, gloo's threads can
    abort the process after a heal that succeeded); one that raised leaves it (its peers may be mid-collective)."""
    import torch.distributed as dist

    from kvconvert.commands.heal import process_group_released

    _one_process_group(tmp_path / "first")
    with process_group_released():
        assert dist.is_initialized()
    assert not dist.is_initialized()
    _one_process_group(tmp_path / "second")
    try:
        with pytest.raises(RuntimeError), process_group_released():
            raise RuntimeError("a failed heal")
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size, code", [("2", 0), (None, 3)])
def test_a_launched_process_ends_without_teardown_and_a_single_one_returns(world_size, code):
    """Under a launcher (WORLD_SIZE > 1) the heal command's process ends right after its output is flushed, exit 0;
    a single process returns to its caller (here: to an exit of its own)."""
    script = ("import sys; from kvconvert.commands.heal import end_launched_process; print('healed', end=''); "
              "end_launched_process(); sys.exit(3)")
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"} | ({"WORLD_SIZE": world_size} if world_size else {})
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert (proc.returncode, proc.stdout) == (code, "healed"), proc.stderr[-2000:]
