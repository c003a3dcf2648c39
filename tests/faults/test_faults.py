"""Every known fault (bad input, interrupted runs, a new user's first mistakes) through the real CLI
in a subprocess: exit code, the one-line message, and nothing left at the output path.
docs/reliability.md's table lists the same cases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from eval_fixtures import gen_records, make_report

ROOT = Path(__file__).resolve().parents[2]
TINY_CAL = ["--kv-dtype", "fp8", "--observer", "amax", "--calib-tokens", "256", "--window-len", "64",
            "--batch-size", "2", "--quiet", "--threads", "1"]
TINY_MLA = ["--rank", "16", "--target", "any", "--calib-tokens", "512", "--calib-window", "128", "--dtype", "bf16"]
ENV = dict(os.environ, TRITON_INTERPRET="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")


def kvconvert(*args, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvconvert.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=timeout)


def command_args(command: str, src: Path, out: Path, base: Path | None = None) -> list:
    """One command's arguments on the model `src` writing `out` (validate compares it with `base`)."""
    return {"mla": ["mla", "--src", src, *TINY_MLA, "--out", out],
            "calibrate": ["calibrate", "--src", src, *TINY_CAL, "--out", out],
            "generate": ["generate", "--model", src, "--prompt", "the function", "--greedy", "--max-new-tokens", "2"],
            "heal": ["heal", "--student", src, "--teacher", src, "--recipe", "layerwise", "--out", out],
            "validate": ["validate", "--source", base or src, "--candidate", src, "--suite", "smoke", "--out", out],
            "pipeline": ["pipeline", "--src", src, "--rank", "16", "--target", "any", "--out", out]}[command]


def error_line(done: subprocess.CompletedProcess) -> str:
    """The CLI's one-line error (no traceback anywhere)."""
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def nothing_left(out: Path) -> None:
    """No output and no hidden temp/probe folder beside it."""
    assert not out.exists()
    if out.parent.is_dir():
        assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def refused(done, out: Path | None, *expected: str) -> str:
    assert done.returncode == 2, done.stderr
    line = error_line(done)
    for text in expected:
        assert text in line, line
    if out is not None:
        nothing_left(out)
    return line


# ------------------------------------------------------------------ silently wrong before

# fault -> what every command's one-line refusal says ({src}: the faulty model's folder)
REFUSALS = {
    "sliding": ("{src}/config.json: not supported: sliding-window attention", "sliding_window=256"),
    # the up-front scan names the file and tensor (mla used to find it only on reaching layer 1)
    "nan": ("{src}/model.safetensors: tensor 'model.layers.1.self_attn.k_proj.weight' contains NaN",),
    "missing": ("{src}/model.safetensors: tensor 'model.layers.1.self_attn.k_proj.weight' is missing",),
    "bias": ("tensor 'model.layers.0.self_attn.q_proj.bias' is missing", "attention_bias is true"),
}


@pytest.mark.parametrize("fault, command", [
    *[("sliding", c) for c in ("mla", "calibrate", "generate", "validate")],
    *[("nan", c) for c in ("generate", "mla", "calibrate", "validate")],
    *[("missing", c) for c in ("generate", "calibrate", "mla")],
    ("bias", "calibrate"),
])
def test_faulty_checkpoint_refused_before_any_work(faults, tmp_path, fault, command):
    src, out = faults[fault], tmp_path / "out"
    done = kvconvert(*command_args(command, src, out, faults["base"]))
    refused(done, out, *(text.format(src=src) for text in REFUSALS[fault]))
    assert done.stdout.strip() == ""  # generate printed token ids [7042, 0, 0, ...] before a NaN


def test_inspect_reports_what_the_commands_refuse(faults):
    from kvconvert.model_info import inspect_report, load_model_info

    notes = inspect_report(load_model_info(str(faults["sliding"]), prefer_preset=False))["notes"]
    assert any(n.startswith("not supported by kvconvert") and "sliding_window=256" in n for n in notes)


def test_calib_tokens_below_one_window_refused(faults, tmp_path):
    out = tmp_path / "out"
    args = [a if a != "256" else "10" for a in TINY_CAL]
    refused(kvconvert("calibrate", "--src", faults["base"], *args, "--out", out), out,
            "--calib-tokens 10 is less than one window (64)")


# ------------------------------------------------------------------ writability and space

@pytest.mark.parametrize("command", ["mla", "calibrate", "heal", "validate", "pipeline"])
def test_read_only_output_refused_at_start(faults, tmp_path, mounts, command):
    ro = mounts(tmp_path / "ro", "ro,size=1m")
    out = ro / "out"
    t0 = time.time()
    done = kvconvert(*command_args(command, faults["base"], out))
    refused(done, out, f"{out}: cannot write in {ro} (Read-only file system)")
    assert time.time() - t0 < 60  # refused at start: calibrate used to fail only after calibrating


def test_plan_refuses_at_start_what_its_candidates_would_not_fit(faults, tmp_path, mounts):
    """plan writes a checkpoint per measured candidate (here the source in fp8 and an MLA conversion, ~9.7 MB
    each): on a disk that holds one, it refuses before any work instead of failing at the second."""
    from kvconvert.checkpoint import estimate_checkpoint_bytes

    one_copy = estimate_checkpoint_bytes(faults["tied"], untie=True)
    disk = mounts(tmp_path / "small", f"size={int(one_copy * 1.5) // 4096 * 4096}")
    out = disk / "plan"
    done = kvconvert("plan", "--src", faults["tied"], "--kv-budget", "50%", "--target", "any", "--out", out)
    refused(done, out, f"{out}: not enough disk space")
    assert "source fp8, MLA 24+8 bf16" in done.stdout  # the two survivors it would have built


@pytest.mark.parametrize("out, problem", [("afile", "exists and is a file, not a folder"),
                                          ("afile/out", "{tmp}/afile is a file, not a folder")])
def test_output_that_is_or_is_below_a_file_refused(tmp_path, out, problem):
    """check_writable, which every writing command runs first (the read-only test above: through each CLI)."""
    from kvconvert.checkpoint import check_writable
    from kvconvert.errors import CheckpointError

    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match=f"{tmp_path / out}: {problem.format(tmp=tmp_path)}"):
        check_writable(tmp_path / out)


def test_tied_source_size_estimate_counts_lm_head(faults, tmp_path, mounts):
    """The estimate covers lm_head's own copy: on a disk between the old and the true size, mla
    refuses at start (it used to fail after the whole conversion)."""
    from kvconvert.checkpoint import CheckpointReader, estimate_checkpoint_bytes

    src = faults["tied"]
    old_estimate = CheckpointReader(src).total_bytes * 2 / 4 * 1.2  # the formula this replaces
    new_estimate = estimate_checkpoint_bytes(src, 2, untie=True) * 1.2
    disk = mounts(tmp_path / "small", f"size={int(old_estimate * 1.3) // 4096 * 4096}")
    out = disk / "out"
    refused(kvconvert("mla", "--src", src, *TINY_MLA, "--out", out), out, f"{out}: not enough disk space")
    # the real output of the same conversion on a large disk
    big = tmp_path / "big"
    done = kvconvert("mla", "--src", src, *TINY_MLA, "--out", big)
    assert done.returncode == 0, done.stderr
    written = sum(p.stat().st_size for p in big.iterdir())
    assert old_estimate < written <= new_estimate


def test_disk_full_mid_write_leaves_nothing(tmp_path, mounts):
    """ENOSPC on a non-shard file (the tokenizer copy): one line, temp folder removed."""
    import torch

    from kvconvert.checkpoint import CheckpointWriter
    from kvconvert.errors import CheckpointError

    disk = mounts(tmp_path / "full", "size=256k")
    big = tmp_path / "tokenizer.json"
    big.write_bytes(b"x" * 400_000)
    out = disk / "out"
    with pytest.raises(CheckpointError, match=r"disk full while writing tokenizer.json; nothing was left"):
        with CheckpointWriter(out) as w:
            w.add("a", torch.zeros(16))
            w.write_config({"model_type": "llama"})
            w.copy_tokenizer(tmp_path)
    nothing_left(out)


def test_result_cache_unwritable_or_full_says_what_to_do(tmp_path, mounts):
    """validate's per-sample cache (OUT/cache): a read-only folder is refused when the cache is made,
    before any sample runs; a full disk at the sample that does not fit; the samples written before
    it are kept for the rerun (both were a raw OSError)."""
    from kvconvert.errors import KVConvertError
    from kvconvert.eval.cache import ResultCache

    ro = mounts(tmp_path / "ro", "ro,size=1m")
    with pytest.raises(KVConvertError, match=rf"{ro}/cache: cannot write in {ro} \(Read-only file system\); choose"):
        ResultCache(ro / "cache")
    cache = ResultCache(mounts(tmp_path / "full", "size=64k") / "cache")
    cache.put("model", "task", "s0", "h0", {"score": 1.0})
    with pytest.raises(KVConvertError, match=r"model__task.jsonl: cannot write the result cache \(No space left on "
                                             r"device\); free disk space or choose another --out .* are reused"):
        cache.put("model", "task", "s1", "h1", {"text": "x" * 200_000})
    assert ResultCache(tmp_path / "full" / "cache").get("model", "task", "s0", "h0") == {"score": 1.0}


# ------------------------------------------------------------------ interrupted runs

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_of_a_dead_run_is_removed(faults, tmp_path):
    out = tmp_path / "out"
    stale = tmp_path / f".out.tmp-{_dead_pid()}"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"half")
    done = kvconvert("calibrate", "--src", faults["base"], *TINY_CAL, "--out", out)
    assert done.returncode == 0, done.stderr
    assert f"kvconvert: removed {stale}, left by an interrupted run" in done.stderr
    assert not stale.exists() and (out / "manifest.json").is_file()


def test_temp_of_a_live_run_is_refused(faults, tmp_path):
    out = tmp_path / "out"
    live = tmp_path / f".out.tmp-{os.getpid()}"  # this test process: alive
    live.mkdir()
    done = kvconvert("calibrate", "--src", faults["base"], *TINY_CAL, "--out", out)
    assert done.returncode == 2
    assert f"process {os.getpid()} is writing this output now" in error_line(done)
    assert live.is_dir() and not out.exists()


def test_sigterm_mid_write_cleans_up_like_ctrl_c(faults, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "kvconvert.cli", "mla", "--src", str(faults["base"]), "--rank", "16",
                             "--target", "any", "--out", str(out)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".out.tmp-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert list(tmp_path.glob(".out.tmp-*")), "the conversion finished before its temp folder was seen"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Interrupted: nothing was left half-written at the output path." in err and "Traceback" not in err
    nothing_left(out)


# ------------------------------------------------------------------ generate input

def test_prompt_from_file_and_stdin_match_the_argument(faults, tmp_path):
    prompt = "the function returns the value of the object"
    (tmp_path / "p.txt").write_text(prompt)
    common = ["generate", "--model", faults["base"], "--greedy", "--max-new-tokens", "4", "--json"]
    runs = [kvconvert(*common, "--prompt", prompt), kvconvert(*common, "--prompt-file", tmp_path / "p.txt"),
            kvconvert(*common, "--prompt-file", "-", stdin=prompt)]
    ids = [json.loads(r.stdout)["token_ids"] for r in runs]
    assert all(r.returncode == 0 for r in runs) and ids[0] == ids[1] == ids[2] and len(ids[0]) == 4


def test_long_prompt_file_gets_the_runtime_message(faults, tmp_path):
    """600 KB cannot pass as one argument (execve limit 128 KiB); from a file it reaches the
    runtime, which says the prompt is too long for the model."""
    (tmp_path / "long.txt").write_text("the value " * 60_000)
    done = kvconvert("generate", "--model", faults["base"], "--prompt-file", tmp_path / "long.txt", "--greedy")
    assert done.returncode == 2 and "(max_model_len); shorten the prompt" in error_line(done)


def test_prompt_and_prompt_file_together_refused(faults, tmp_path):
    refused(kvconvert("generate", "--model", faults["base"], "--prompt", "a", "--prompt-file", "-"), None,
            "give exactly one of --prompt TEXT or --prompt-file PATH")


# ------------------------------------------------------------------ statistics and messages

def test_gate_claims_no_interval_from_one_sample_per_task(tmp_path):
    """LongBench-mini in the quick suite: one sample per task gave a zero-width "95% interval"."""
    samples = {f"longbench/{t}": gen_records([0.5], [0.4]) for t in ("a", "b", "c")}
    samples["passkey"] = gen_records([1.0] * 10, [1.0] * 10)
    (tmp_path / "report.json").write_text(json.dumps(make_report(samples)))
    policy = tmp_path / "p.yaml"
    policy.write_text("thresholds:\n  longbench_avg_drop: 2.0\n  passkey_accuracy_drop: 10\n")
    done = kvconvert("gate", "--report", tmp_path / "report.json", "--policy", policy)
    assert done.returncode == 1, done.stdout + done.stderr  # no interval: INCONCLUSIVE, which blocks by default
    assert "INCONCLUSIVE" in done.stdout and "not enough samples for an interval" in done.stdout
    policy.write_text("on_inconclusive: pass\nthresholds:\n  longbench_avg_drop: 2.0\n  passkey_accuracy_drop: 10\n")
    done = kvconvert("gate", "--report", tmp_path / "report.json", "--policy", policy)
    assert done.returncode == 0 and "gate passed with INCONCLUSIVE metrics (longbench_avg_drop)" in done.stdout
    assert "[+10.000, +10.000]" not in done.stdout
    policy.write_text("require: [longbench_avg_drop]\nthresholds:\n  longbench_avg_drop: 2.0\n")
    assert kvconvert("gate", "--report", tmp_path / "report.json", "--policy", policy).returncode == 1
    policy.write_text("decide_on: point\nthresholds:\n  longbench_avg_drop: 2.0\n")  # declared non-statistical rule
    done = kvconvert("gate", "--report", tmp_path / "report.json", "--policy", policy)
    assert done.returncode == 1 and "FAIL" in done.stdout  # 10 points > 2 on the estimate


def test_truncated_report_says_rerun_validate(tmp_path):
    text = json.dumps(make_report({"passkey": gen_records([1.0] * 4, [1.0] * 4)}))
    (tmp_path / "report.json").write_text(text[: len(text) // 2])
    policy = ROOT / "recipes" / "gates" / "default.yaml"
    refused(kvconvert("gate", "--report", tmp_path / "report.json", "--policy", policy), None,
            "truncated or corrupt?", "re-run kvconvert validate")


def test_unknown_recipe_key_lists_the_allowed_keys(faults, tmp_path):
    (tmp_path / "r.yaml").write_text("convert:\n  rank: 16\n  rnak: 8\n")
    out = tmp_path / "out"
    refused(kvconvert("pipeline", "--src", faults["base"], "--recipe", tmp_path / "r.yaml", "--out", out), out,
            "unknown key 'convert.rnak' (allowed here: rank, rope_dim, q_rank")


def test_missing_tensor_in_a_sharded_checkpoint_names_the_layers_shard(faults, tmp_path):
    """Sharded: the message names the shard that holds the rest of the layer (in-process: the
    check itself; the CLI paths above run the same function)."""
    from kvconvert.checkpoint import CheckpointReader, CheckpointWriter, check_tensors_present
    from kvconvert.errors import CheckpointError

    src = CheckpointReader(faults["base"])
    gone = "model.layers.1.mlp.up_proj.weight"
    with CheckpointWriter(tmp_path / "sharded", max_shard_bytes=64 * 1024) as w:
        for name in src.keys():
            if name != gone:
                w.add(name, src.get(name))
        w.write_config(src.config)
    reader = CheckpointReader(tmp_path / "sharded")
    shards = {f for k, f in reader.weight_map.items() if k.startswith("model.layers.1.mlp.")}
    assert len(set(reader.weight_map.values())) > 2
    with pytest.raises(CheckpointError, match=rf"tensor '{gone}' is missing; config.json requires it") as info:
        check_tensors_present(reader)
    assert str(info.value).split(":")[0] in {str(tmp_path / "sharded" / f) for f in shards}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2"])
def test_all_finite_matches_isfinite_reference(dtype):
    """The scan's min/max test against torch.isfinite(t).all(), for NaN / +inf / -inf anywhere,
    non-contiguous views and empty tensors (exact: a boolean per tensor)."""
    import torch

    from kvconvert.checkpoint.writer import _all_finite

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    assert _all_finite(torch.empty(0, dtype=dt))
    for bad in (float("nan"), float("inf"), float("-inf"), None):
        for pos in (0, 777, 4095):
            t = torch.randn(64, 64, generator=gen)
            if bad is not None:
                t.view(-1)[pos] = bad
            t = t.to(dt)  # e4m3fn has no inf: the cast makes it NaN
            for view in (t, t.t(), t[::2]):
                assert _all_finite(view) == bool(torch.isfinite(view.float()).all()), (bad, pos)


# ------------------------------------------------------------------ the faults a new user hits

FAST = ["generate", "mla", "calibrate", "validate", "heal", "pipeline"]  # every command that reads a checkpoint


def _fast_refusal(done, out: Path, seconds: float, *expected: str) -> None:
    """Refused with one line, nothing written, nothing printed on stdout, and quickly (before any work:
    mla used to fail after 14 s on SmolLM2; 60 s leaves room for a loaded machine's imports)."""
    refused(done, out, *expected)
    assert done.stdout.strip() == ""
    assert seconds < 60


@pytest.mark.parametrize("command", FAST)
def test_index_listing_a_tensor_its_shard_lacks_is_named_with_the_shard(faults, tmp_path, command):
    """A partial download: the index lists layer 1's k_proj, its shard lacks it. Every command used to end
    in a KeyError traceback (exit 1); the reader's header check names the shard before any work."""
    src, out, name = faults["partial"], tmp_path / "out", "model.layers.1.self_attn.k_proj.weight"
    shard = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    t0 = time.time()
    done = kvconvert(*command_args(command, src, out, faults["base"]))
    _fast_refusal(done, out, time.time() - t0,
                  f"{src / shard}: tensor '{name}' is listed in model.safetensors.index.json but not in this file",
                  "re-download")


@pytest.mark.parametrize("command", FAST)
def test_missing_tokenizer_files_named_before_any_work(faults, tmp_path, command):
    src, out = faults["notok"], tmp_path / "out"
    t0 = time.time()
    done = kvconvert(*command_args(command, src, out, faults["base"]))
    _fast_refusal(done, out, time.time() - t0, f"{src}: no tokenizer files (none of tokenizer.json")


@pytest.mark.parametrize("command, where", [("mla", "same"), ("calibrate", "inside"), ("heal", "contains"),
                                            ("pipeline", "same"), ("plan", "inside")])
def test_output_that_is_holds_or_lies_in_the_source_refused_even_with_overwrite(faults, tmp_path, command, where):
    """`mla --src D --out D --overwrite` used to replace the source by its conversion."""
    import shutil

    src = tmp_path / "models" / "src"
    shutil.copytree(faults["base"], src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    out = {"same": src, "inside": src / "converted", "contains": tmp_path / "models"}[where]
    args = (["plan", "--src", src, "--kv-budget", "50%", "--target", "any", "--out", out] if command == "plan"
            else [*command_args(command, src, out), "--overwrite"])
    done = kvconvert(*args)
    text = {"same": "is the source", "inside": "lies inside the source", "contains": "contains the source"}[where]
    refused(done, None, f"{out}: --out {text} {src.resolve()}", "--overwrite does not change that")
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # the source untouched
    assert not (src / "converted").exists()


@pytest.mark.parametrize("args, message", [
    (["calibrate", *[a if a != "256" else "300" for a in TINY_CAL]],
     "--calib-tokens 300 is not a whole number of 64-token windows (--window-len 64): only 256 would be used; "
     "use --calib-tokens 256 or 320"),
    (["mla", *[a if a != "512" else "600" for a in TINY_MLA]],
     "--calib-tokens 600 is not a whole number of 128-token windows (--calib-window 128): only 512 would be used"),
    (["plan", "--kv-budget", "50%", "--calib-tokens", "1000"],
     "--calib-tokens 1000 is not a whole number of 512-token windows"),
])
def test_token_count_that_is_not_whole_windows_refused(faults, tmp_path, args, message):
    """`calibrate --calib-tokens 1000` with 512-token windows calibrated on 512 and said 1000 elsewhere."""
    out = tmp_path / "out"
    refused(kvconvert(args[0], "--src", faults["base"], *args[1:], "--out", out), out, message)


def test_reports_record_the_tokens_really_used(faults, tmp_path):
    """A whole number of windows: calibrate's report and mla's summary say the tokens used."""
    done = kvconvert("calibrate", "--src", faults["base"], *TINY_CAL, "--out", tmp_path / "cal")
    assert done.returncode == 0, done.stderr
    assert "256 tokens" in done.stdout
    report = json.loads((tmp_path / "cal" / "calibration_report.json").read_text())["calibration"]
    assert (report["tokens"], report["windows"], report["window_len"]) == (256, 4, 64)
    done = kvconvert("mla", "--src", faults["base"], *TINY_MLA, "--out", tmp_path / "mla", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["calib_tokens"] == 512
    assert json.loads((tmp_path / "mla" / "manifest.json").read_text())["kvconvert_mla"]["calib_tokens"] == 512


def test_pipeline_reuses_an_artifact_only_for_its_source_and_options(faults, tmp_path):
    """pipeline --src A then --src B (same config, other weights) into the same --out: the second run used to
    reuse O/source-fp8 (A's) and validate B against A's model."""
    out = tmp_path / "O"
    common = ["--no-mla", "--calib-tokens", "512", "--suite", "smoke", "--out", out]
    first = kvconvert("pipeline", "--src", faults["base"], *common)
    assert first.returncode == 0, first.stderr
    artifact = out / "source-fp8"
    built_from_a = (artifact / "manifest.json").read_text()
    second = kvconvert("pipeline", "--src", faults["other"], *common)
    assert second.returncode == 0, second.stderr
    assert f"not reusing {artifact}: it was built from other weights ({faults['base']}" in second.stderr
    assert (artifact / "manifest.json").read_text() != built_from_a  # rebuilt from B
    record = json.loads((out / "provenance.json").read_text())["source-fp8"]
    assert record["source"] == str(faults["other"]) and record["options"]["options"]["calib_tokens"] == 512
    third = kvconvert("pipeline", "--src", faults["other"], *common)  # same source and options: reused
    assert third.returncode == 0 and f"reusing {artifact}, built from {faults['other']}" in third.stderr


def test_validate_does_not_reuse_results_of_weights_edited_in_place(faults, tmp_path):
    """The candidate's weights edited in place (one tensor scaled by 0.3, same file size): the rerun used to
    reuse the stored results, because the fingerprint trusted manifest.json whenever sizes matched."""
    import shutil

    import torch
    from safetensors import safe_open

    candidate = tmp_path / "candidate"
    shutil.copytree(faults["written"], candidate)  # with a manifest.json
    report = tmp_path / "R"
    args = ["validate", "--source", faults["base"], "--candidate", candidate, "--suite", "smoke"]
    assert kvconvert(*args, "--out", report).returncode == 0
    before = json.loads((report / "report.json").read_text())
    weights, name = candidate / "model.safetensors", "model.layers.0.self_attn.v_proj.weight"
    with safe_open(weights, "pt") as f:
        scaled = f.get_tensor(name) * 0.3
    from kvconvert.st_header import safetensors_header

    start, end = safetensors_header(weights)[name]["data_offsets"]
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # in place: same size, new mtime
        base = 8 + int.from_bytes(f.read(8), "little")
        f.seek(base + start)
        f.write(scaled.contiguous().view(torch.uint8).numpy().tobytes())
    assert weights.stat().st_size == size and end - start == scaled.numel() * 4
    rerun = kvconvert(*args, "--out", report)
    fresh = kvconvert(*args, "--out", tmp_path / "fresh")
    assert rerun.returncode == 0 and fresh.returncode == 0, rerun.stderr + fresh.stderr

    after, fresh = (json.loads((folder / "report.json").read_text()) for folder in (report, tmp_path / "fresh"))
    assert after["candidate"]["fingerprint"] != before["candidate"]["fingerprint"]
    assert after["metrics"] == fresh["metrics"] != before["metrics"]  # measured again, not reused


def test_interrupted_plan_leaves_no_empty_out(faults, tmp_path):
    out = tmp_path / "plan"
    proc = subprocess.Popen([sys.executable, "-m", "kvconvert.cli", "plan", "--src", str(faults["base"]),
                             "--kv-budget", "50%", "--target", "any", "--out", str(out)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not out.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert out.exists(), "plan finished or failed before making its --out"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert not out.exists() or any(p.is_file() for p in out.rglob("*"))  # nothing, or finished files only
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_dir() and not any(p.iterdir())]


def test_generate_says_when_the_context_ran_out(faults, tmp_path):
    """A prompt that nearly fills the 512-token context and --max-new-tokens 16: a "length" finish after a few
    tokens used to come with no word that the context, not --max-new-tokens, ended it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(faults["base"]))
    words = "the value of the function returns the object".split()
    prompt = " ".join(words[i % len(words)] for i in range(505))
    n = len(tok(prompt, add_special_tokens=False).input_ids)
    (tmp_path / "p.txt").write_text(prompt)
    done = kvconvert("generate", "--model", faults["base"], "--prompt-file", tmp_path / "p.txt", "--greedy",
                     "--max-new-tokens", "16", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["finish_reason"] == "length" and result["prompt_tokens"] == n
    assert len(result["token_ids"]) == 512 - n < 16
    note = f"the context ran out after {512 - n} of --max-new-tokens 16 new tokens"
    assert note in result["note"] and f"note: {note}" in done.stderr
    short = kvconvert("generate", "--model", faults["base"], "--prompt", "the value", "--greedy",
                      "--max-new-tokens", "4", "--json")
    assert "note" not in json.loads(short.stdout) and "context ran out" not in short.stderr


def test_fingerprint_follows_in_place_edits_keeps_copies_and_trusts_fresh_manifests(faults, tmp_path, monkeypatch):
    """kvconvert.checkpoint.fingerprint in-process (validate's cache and the pipeline's provenance use it)."""
    import shutil

    from kvconvert.checkpoint.fingerprint import checkpoint_fingerprint

    monkeypatch.setenv("KVCONVERT_HOME", str(tmp_path / "home"))
    hashes = tmp_path / "home" / "hashes"
    original = checkpoint_fingerprint(faults["written"])
    assert not hashes.exists()  # a fresh CheckpointWriter output: its manifest's hashes, no file read
    copy = tmp_path / "copy"
    shutil.copytree(faults["written"], copy, copy_function=shutil.copyfile)  # new mtimes, same bytes
    assert checkpoint_fingerprint(copy) == original and len(list(hashes.iterdir())) >= 2  # hashed once, cached
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(4 - i for i in range(4))  # the last value of the last tensor, in place
    weights.write_bytes(bytes(data))
    assert weights.stat().st_size == (faults["written"] / "model.safetensors").stat().st_size
    assert checkpoint_fingerprint(copy) != original
    weights.write_bytes((faults["written"] / "model.safetensors").read_bytes())  # restored: the same weights again
    assert checkpoint_fingerprint(copy) == original
