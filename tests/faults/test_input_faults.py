"""A new user's bad inputs through the real CLI in a subprocess: a config.json that is not what it claims,
tensors whose shapes disagree with it, recipes and policies that are not UTF-8, an --out that is a
symlink loop, a full disk during validate, and a multi-process launch of a single-process command.
Each used to end in a Python traceback (exit 1); each is now one `error:` line (exit 2) before any work.
docs/reliability.md's table lists the same cases."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_faults import ENV, ROOT, TINY_CAL, command_args, error_line, kvconvert, nothing_left, refused

FAST = ["generate", "mla", "calibrate", "validate", "heal", "pipeline"]  # every command that reads a checkpoint


def _before_any_work(done, out: Path | None, seconds: float, *expected: str) -> str:
    """One line, exit 2, nothing written or printed on stdout, and quickly (the checks read config.json and
    the safetensors headers only)."""
    line = refused(done, out, *expected)
    assert done.stdout.strip() == ""
    assert seconds < 60
    return line


def _run(command: str, src: Path, out: Path, base: Path, student: Path | None = None):
    """`command` on the faulty model `src` (validate: as the candidate of `base`; heal: as the teacher of
    `student`, an MLA checkpoint)."""
    t0 = time.time()
    if command == "heal":
        args = ["heal", "--student", student, "--teacher", src, "--recipe", "layerwise", "--out", out]
    elif command == "plan":
        args = ["plan", "--src", src, "--kv-budget", "50%", "--target", "any", "--out", out]
    else:
        args = command_args(command, src, out, base)
    return kvconvert(*args), time.time() - t0


# ------------------------------------------------------------------ config.json that is not what it claims

CONFIG_FAULTS = {  # fault -> what the one line says ({src}: the model folder)
    "latin1": ("{src}/config.json: config.json is not UTF-8 text (byte 0xe9 at offset", "save it as UTF-8"),
    "list": ("{src}/config.json: config.json holds a list, not a JSON object",),
    "no_hidden": ("{src}/config.json: hidden_size is missing; kvconvert reads the weights' shapes from it",),
    "kv0": ("{src}/config.json: num_key_value_heads is 0; it must be a positive integer",),
    "layers_str": ("{src}/config.json: num_hidden_layers is the string '2', not a number; write it without quotes: "
                   '"num_hidden_layers": 2',),
    # the config (here its default) and the tensors disagree: both named, and the fix
    "no_kv": ("{src}/model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape [32, 64]: it "
              "holds 2 KV heads of head_dim 16, but config.json has no num_key_value_heads, so 4 (transformers' "
              'default: num_attention_heads); if the weights are right, set "num_key_value_heads": 2',
              "(3 more tensors disagree too)"),
}


@pytest.mark.parametrize("fault, command", [(f, c) for f in CONFIG_FAULTS for c in ("calibrate", "mla")])
def test_config_that_is_not_what_it_claims_refused(input_faults, faults, tmp_path, fault, command):
    """calibrate: UnicodeDecodeError, AttributeError ('list' has no 'get'), KeyError 'hidden_size',
    RuntimeError (unflatten: sizes [4, 16] don't multiply up) for a missing or 0 num_key_value_heads,
    TypeError (a string num_hidden_layers); mla: the same, IndexError for the KV heads."""
    src, out = input_faults[fault], tmp_path / "out"
    done, seconds = _run(command, src, out, faults["base"])
    _before_any_work(done, out, seconds, *(t.format(src=src) for t in CONFIG_FAULTS[fault]))


@pytest.mark.parametrize("command", [*FAST, "plan"])
def test_every_command_runs_the_same_check(input_faults, faults, tmp_path, command):
    """One check where the model is first read (kvconvert.checkpoint.check_checkpoint), for every command."""
    src, out = input_faults["no_kv"], tmp_path / "out"
    done, seconds = _run(command, src, out, faults["base"], student=input_faults["mla"])
    _before_any_work(done, out, seconds, f"{src}/model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' "
                                         "has shape [32, 64]: it holds 2 KV heads")


def test_missing_kv_heads_follow_transformers_when_the_weights_agree(input_faults):
    """No num_key_value_heads over MHA weights (4 KV heads = num_attention_heads): transformers' default
    is right, so the model runs."""
    done = kvconvert("generate", "--model", input_faults["no_kv_mha"], "--prompt", "the function", "--greedy",
                     "--max-new-tokens", "2", "--json")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------ tensors whose shapes disagree with config.json

SHAPE_FAULTS = {
    "transposed": ("{src}/model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape [64, 32], "
                   "but config.json implies [32, 64] ([num_key_value_heads x head_dim, hidden_size]); it is stored "
                   "transposed",),
    "wrong_size": ("{src}/model.safetensors: tensor 'model.layers.0.self_attn.v_proj.weight' has shape [32, 32], "
                   "but config.json implies [32, 64]",),
    "norm": ("{src}/model.safetensors: tensor 'model.layers.0.input_layernorm.weight' has shape [8, 8], but "
             "config.json implies [64] ([hidden_size])",),
    "mla_kv_b": ("{src}/model.safetensors: tensor 'model.layers.1.self_attn.kv_b_proj.weight' has shape [32, 128], "
                 "but config.json implies [128, 32] ([num_attention_heads x (qk_nope_head_dim + v_head_dim), "
                 "kv_lora_rank]); it is stored transposed",),
    "mla_no_rank": ("{src}/config.json: kv_lora_rank is missing",),
}


@pytest.mark.parametrize("fault, command", [
    *[(f, c) for f in ("transposed", "wrong_size", "norm") for c in ("calibrate", "generate")],
    ("transposed", "mla"), ("mla_kv_b", "generate"), ("mla_no_rank", "generate"),
])
def test_tensor_shapes_checked_against_config_before_any_work(input_faults, faults, tmp_path, fault, command):
    """calibrate and generate: "mat1 and mat2 shapes cannot be multiplied", "shape '[16, 64]' is invalid for
    input of size 2048", "The size of tensor a (8) must match..." (DeepSeek-V3: a KeyError for kv_lora_rank)."""
    src, out = input_faults[fault], tmp_path / "out"
    done, seconds = _run(command, src, out, faults["base"])
    _before_any_work(done, out, seconds, *(t.format(src=src) for t in SHAPE_FAULTS[fault]))


def test_expected_shapes_match_real_checkpoints(input_faults, faults):
    """The shapes config.json implies are the shapes transformers wrote, tensor for tensor (Llama with GQA,
    MHA and DeepSeek-V3 MLA): the check refuses only what disagrees."""
    from kvconvert.checkpoint import CheckpointReader
    from kvconvert.checkpoint.checks import _stored_shapes, expected_shapes

    for folder in (faults["base"], input_faults["no_kv_mha"], input_faults["mla"]):
        reader = CheckpointReader(folder)
        expected, stored = expected_shapes(reader.config), _stored_shapes(reader)
        checked = [name for name in stored if name in expected]
        assert len(checked) == len(stored), sorted(set(stored) - set(expected))  # every tensor has a known shape
        assert all(stored[name] == expected[name][0] for name in checked)


# ------------------------------------------------------------------ recipes and policies that are not UTF-8

@pytest.mark.parametrize("content, byte", [(b"convert:\n  rank: 16  # caf\xe9\n", "0xe9"),
                                           (b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)), "0x80")])
def test_recipe_that_is_not_utf8_refused(faults, tmp_path, content, byte):
    recipe, out = tmp_path / "r.yaml", tmp_path / "out"
    recipe.write_bytes(content)
    refused(kvconvert("pipeline", "--src", faults["base"], "--recipe", recipe, "--out", out), out,
            f"{recipe}: not UTF-8 text (byte {byte} at offset", "save it as UTF-8")


def test_policy_that_is_not_utf8_refused(tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_bytes(b"thresholds:\n  kl_mean: 0.05\xff\n")
    (tmp_path / "report.json").write_text("{}")  # the policy is read first
    refused(kvconvert("gate", "--report", tmp_path / "report.json", "--policy", policy), None,
            f"{policy}: not UTF-8 text (byte 0xff at offset 27)")


# ------------------------------------------------------------------ an --out that is a symlink loop

@pytest.mark.parametrize("command, below", [("calibrate", False), ("mla", False), ("validate", False),
                                            ("calibrate", True)])
def test_output_that_is_a_symlink_loop_refused(faults, tmp_path, command, below):
    """`RuntimeError: Symlink loop from ...` in calibrate and mla; validate said FileExistsError."""
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    out = tmp_path / "a" / "sub" if below else tmp_path / "a"
    done = kvconvert(*command_args(command, faults["base"], out))
    refused(done, None, f"{out}: --out runs into a symlink loop at {tmp_path / 'a'} (-> b); remove or fix that link")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temp or probe folder beside it


# ------------------------------------------------------------------ a full disk during validate

def _validate(base: Path, out: Path, home: Path, *extra: str):
    env = dict(ENV, KVCONVERT_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "kvconvert.cli", "validate", "--source", str(base), "--candidate",
                           str(base), "--suite", "smoke", "--out", str(out), "--no-progress", *extra],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def _partial_files(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if ".tmp-" in p.name]


def test_full_kvconvert_home_keeps_the_logits_under_out(faults, tmp_path, mounts):
    """KVCONVERT_HOME with 64 KiB: the source's logits (2 windows, 528 KiB) used to end in a SafetensorError
    traceback; now the run keeps them under --out, says which folder lacked how much, and leaves nothing
    half-written in KVCONVERT_HOME."""
    home = mounts(tmp_path / "home", "size=64k")
    done = _validate(faults["base"], tmp_path / "R", home)
    assert done.returncode == 0, done.stderr
    note = re.search(rf"note: {home}/validate/logits/\w+: not enough disk space \(need 528.0 KiB, [\d.]+ KiB free\) "
                     rf"for the source's logits: this run keeps them in {tmp_path}/R/cache/source-logits-\w+",
                     done.stderr)
    assert note, done.stderr
    assert not list(home.rglob("*.safetensors")) and not _partial_files(home)
    assert (tmp_path / "R" / "report.json").is_file() and not list((tmp_path / "R" / "cache").glob("source-logits-*"))


def test_out_without_room_for_the_logits_refused_before_any_model_runs(faults, tmp_path, mounts):
    """--no-resume keeps the logits under --out: a 256 KiB disk cannot hold them, refused at start."""
    disk = mounts(tmp_path / "small", "size=256k")
    t0 = time.time()
    done = _validate(faults["base"], disk / "R", tmp_path / "home", "--no-resume")
    line = refused(done, None, f"{disk}/R/cache/source-logits-", ": not enough disk space (need 528.0 KiB, 256.0 KiB "
                               "free); free some space or choose another --out")
    assert "source perplexity" not in done.stderr and time.time() - t0 < 60, line
    assert not [p for p in disk.rglob("*") if p.is_file()]  # no file written


def test_out_that_fills_mid_run_says_what_and_leaves_no_partial_file(faults, tmp_path, mounts):
    """A 64 KiB --out fills while the report is written: one line naming the folder, the file and the bytes
    it needed; no half-written file; the result cache keeps whole entries only, for the rerun."""
    disk = mounts(tmp_path / "small", "size=64k")
    done = _validate(faults["base"], disk / "R", tmp_path / "home")
    assert done.returncode == 2, done.stderr
    line = error_line(done)
    # the report's charts do not fit (here), or, with more tasks in the suite, a result-cache entry
    assert line.startswith(f"error: {disk}/R") and re.search(r"needed [\d.]+ (KiB|B), [\d.]+ (KiB|B) free", line), line
    assert "nothing was left half-written" in line or "nothing of it was kept" in line, line
    assert not _partial_files(disk)
    for cache in (disk / "R" / "cache").glob("*.jsonl"):
        assert cache.read_text().endswith("\n")  # whole lines only


def test_tensor_file_on_a_full_disk_names_folder_and_size(tmp_path, mounts):
    """atomic_save_tensors (validate's source logits, heal's layer-wise progress): the safetensors error
    becomes one line with the folder and the bytes needed; the temp file is removed."""
    import torch

    from kvconvert.checkpoint import atomic_save_tensors
    from kvconvert.errors import CheckpointError

    disk = mounts(tmp_path / "full", "size=64k")
    with pytest.raises(CheckpointError, match=rf"^{disk}: disk full while writing w.safetensors \(needed 256.0 KiB, "
                                              r"64.0 KiB free\); nothing was left half-written"):
        atomic_save_tensors({"logits": torch.zeros(128, 512)}, disk / "w.safetensors")
    assert list(disk.iterdir()) == []


def test_result_cache_keeps_no_partial_entry(tmp_path, mounts):
    """An entry that only partly fits is cut off again: the file holds whole lines, as before the write."""
    from kvconvert.errors import KVConvertError
    from kvconvert.eval.cache import ResultCache

    cache = ResultCache(mounts(tmp_path / "full", "size=64k") / "cache")
    cache.put("model", "task", "s0", "h0", {"score": 1.0})
    path = tmp_path / "full" / "cache" / "model__task.jsonl"
    before = path.read_bytes()
    with pytest.raises(KVConvertError, match=r"this one needed 195.\d KiB, [\d.]+ KiB free; nothing of it was kept"):
        cache.put("model", "task", "s1", "h1", {"text": "x" * 200_000})
    assert path.read_bytes() == before


# ------------------------------------------------------------------ multi-process launches

LAUNCHED = dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT="29500")  # what accelerate launch / torchrun set in the second process


def _launched(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvconvert.cli", *map(str, args)], capture_output=True, text=True,
                          env=dict(ENV, **(env or LAUNCHED)), cwd=ROOT, timeout=300)


@pytest.mark.parametrize("command", ["calibrate", "mla", "validate", "generate", "pipeline", "plan"])
def test_single_process_commands_refused_under_a_launcher(faults, tmp_path, command):
    """`accelerate launch --num_processes 2 ... calibrate`: both processes calibrated and raced on one --out."""
    out = tmp_path / "out"
    args = (["plan", "--src", faults["base"], "--kv-budget", "50%", "--out", out] if command == "plan"
            else command_args(command, faults["base"], out))
    done = _launched(*args)
    line = refused(done, out, f"error: kvconvert {command} runs in one process, but a launcher (accelerate launch, "
                              "torchrun) started it as process 1 of 2", "only `kvconvert heal` runs across processes")
    if command == "pipeline":
        assert "`kvconvert mla` (one process), then `accelerate launch ... -m kvconvert.cli heal`" in line
    if command == "mla":
        assert "convert without --heal in one process, then launch `kvconvert heal` on its output" in line


def test_heal_and_single_process_launches_still_run(faults):
    """heal runs across processes (its FSDP test: tests/heal/test_fsdp.py), so the launcher's variables do
    not stop it; a launch of one process (WORLD_SIZE=1) runs any command."""
    assert _launched("heal", "--help").returncode == 0
    done = _launched("generate", "--model", faults["base"], "--prompt", "the function", "--greedy",
                     "--max-new-tokens", "2", env=dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0"))
    assert done.returncode == 0, done.stderr


def test_accelerate_launch_of_calibrate_refused_in_every_process(faults, tmp_path):
    """The real launch: `accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes 2 -m
    kvconvert.cli calibrate ...` (two CPU processes here): each refuses before any work, exit 2. The launcher
    stops the other process (SIGTERM) as soon as one fails, so the slower one either refused too or was
    interrupted before any work, which it says; no process does the job."""
    out = tmp_path / "out"
    config = ROOT / "recipes" / "accelerate" / "fsdp.yaml"
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                           "--num_processes", "2", "-m", "kvconvert.cli", "calibrate", "--src", str(faults["base"]),
                           *TINY_CAL, "--out", str(out)], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: kvconvert calibrate runs in one")]
    refused = sorted(re.search(r"process (\d) of 2", line).group(1) for line in lines)
    interrupted = done.stderr.count("Interrupted: nothing was left half-written at the output path.")
    assert refused and set(refused) <= {"0", "1"} and len(refused) + interrupted == 2, done.stderr
    assert "calibrating" not in done.stderr, done.stderr  # neither process started the job
    assert done.returncode != 0  # the launcher fails when its processes do
    frames = [line for line in done.stderr.splitlines() if line.strip().startswith("File ")]  # the launcher's own
    assert not [f for f in frames if str(ROOT / "kvconvert") + "/" in f], done.stderr
    nothing_left(out)


def test_launch_variables_read_like_the_launchers_set_them(monkeypatch):
    from kvconvert.device import launched_world_size

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert launched_world_size() == 1
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert launched_world_size() == 1  # the first process alone says nothing about the others
    monkeypatch.setenv("RANK", "3")
    assert launched_world_size() == 2  # a later process: at least two
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert launched_world_size() == 8
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launched_world_size() == 1

