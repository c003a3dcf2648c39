"""Faults around the stock engines and the GGUF export, through the real CLI in a subprocess: a broken llama.cpp
install, disks too small or read-only for an export, checkpoints GGUF cannot hold, mistyped paths, and reports
that do not record what was asked. Each is one `error: ...` line (exit 2) before any work, or a correct result."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_faults import ENV, ROOT, kvconvert, refused


def kvconvert_in(cwd: Path, *args, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """test_faults.kvconvert run in the folder `cwd` (relative paths) and/or with another environment."""
    return subprocess.run([sys.executable, "-m", "kvconvert.cli", *map(str, args)], capture_output=True, text=True,
                          env=env or ENV, cwd=cwd, timeout=timeout)


def broken_llama_cpp(folder: Path) -> Path:
    """A copy of the installed llama-cpp-python's Python files without its compiled llama.cpp (as a partial
    install or a wiped build leaves it): `import llama_cpp` finds the package, loading it fails."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        pytest.skip("llama-cpp-python is not installed (bash scripts/setup_llamacpp.sh)")
    package = folder / "llama_cpp"
    shutil.copytree(Path(spec.origin).parent, package, ignore=shutil.ignore_patterns("lib", "*.so*", "__pycache__"))
    return folder


def test_validate_probes_a_broken_llama_cpp_before_the_suite(faults, tmp_path):
    broken = broken_llama_cpp(tmp_path / "site")
    out = tmp_path / "report"
    started = time.time()
    done = kvconvert_in(ROOT, "validate", "--source", faults["base"], "--candidate", faults["base"], "--engine",
                        "llamacpp", "--suite", "smoke", "--no-progress", "--out", out,
                        env=dict(ENV, PYTHONPATH=str(broken)))
    line = refused(done, out, "llama-cpp-python in", "is installed but does not load", "setup_llamacpp.sh")
    assert "log " not in line  # no log file named, let alone a deleted one
    assert "llama.cpp perplexity" not in done.stderr and "Suite" not in done.stderr
    assert time.time() - started < 60, "refused only after work"


# ------------------------------------------------------------------ export-gguf and the engine's exports

def needs_llama_cpp() -> None:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (bash scripts/setup_llamacpp.sh)")


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory, smollm2_path) -> dict[str, Path]:
    """Tiny Llamas with SmolLM2's tokenizer (export-gguf writes its byte-level BPE): "tiny" (4 heads of 32, hidden
    128, tied embeddings: a 27 MB f32 GGUF), "h80" (5 heads of 16: hidden 80, rows of 80 values that are not
    whole q8_0 blocks) and "fp8" (tiny calibrated for an FP8 cache: k_scale / v_scale tensors)."""
    sys.path.insert(0, str(ROOT / "tests" / "mla"))
    from mla_tiny_models import make_tiny_llama
    from test_faults import TINY_CAL

    root = tmp_path_factory.mktemp("gguf_models")
    tiny = make_tiny_llama(root / "tiny", smollm2_path, kv_heads=2, heads=4, head_dim=32)
    h80 = make_tiny_llama(root / "h80", smollm2_path, kv_heads=1, heads=5, head_dim=16)
    done = kvconvert("calibrate", "--src", tiny, *TINY_CAL, "--out", root / "fp8")
    assert done.returncode == 0, done.stderr
    return {"tiny": tiny, "h80": h80, "fp8": root / "fp8"}


def test_export_margin_is_sized_to_the_export(gguf_models, tmp_path, mounts):
    """A 27 MB export fits a 40 MiB disk (a fixed 64 MiB margin refused it); a 20 MiB disk is refused up front."""
    disk = mounts(tmp_path / "disk", "size=40m")
    done = kvconvert("export-gguf", "--src", gguf_models["tiny"], "--out", disk / "tiny.gguf", "--outtype", "f32")
    assert done.returncode == 0, done.stderr
    assert 25e6 < (disk / "tiny.gguf").stat().st_size < 30e6
    small = mounts(tmp_path / "small", "size=20m")
    refused(kvconvert("export-gguf", "--src", gguf_models["tiny"], "--out", small / "tiny.gguf", "--outtype", "f32"),
            small / "tiny.gguf", "not enough disk space")


def test_validate_checks_the_disk_for_the_engines_exports_before_the_suite(gguf_models, tmp_path, mounts):
    needs_llama_cpp()
    out = mounts(tmp_path / "small", "size=20m") / "report"
    done = kvconvert("validate", "--source", gguf_models["tiny"], "--candidate", gguf_models["tiny"], "--engine",
                     "llamacpp", "--suite", "smoke", "--no-progress", "--out", out)
    refused(done, out, "not enough disk space", "--engine llamacpp exports the models to GGUF")


def test_export_of_a_calibrated_checkpoint_names_the_source_to_export(gguf_models, tmp_path):
    out = tmp_path / "fp8.gguf"
    line = refused(kvconvert("export-gguf", "--src", gguf_models["fp8"], "--out", out), out,
                   "holds calibrated KV-cache scales", "GGUF cannot hold",
                   f"Export the model it was calibrated from ({gguf_models['tiny']}) instead")
    assert "no GGUF name" not in line


def test_validate_refuses_a_calibrated_candidate_for_llama_cpp_before_the_suite(gguf_models, tmp_path):
    needs_llama_cpp()
    out = tmp_path / "report"
    refused(kvconvert("validate", "--source", gguf_models["tiny"], "--candidate", gguf_models["fp8"], "--engine",
                      "llamacpp", "--kv-dtype", "q8_0", "--suite", "smoke", "--no-progress", "--out", out),
            out, "holds calibrated KV-cache scales")


def test_export_into_a_read_only_folder_names_out_not_a_probe(gguf_models, tmp_path, mounts):
    folder = mounts(tmp_path / "ro", "ro,size=1m")
    out = folder / "x.gguf"
    line = refused(kvconvert("export-gguf", "--src", gguf_models["tiny"], "--out", out), None,
                   f"{out}: cannot write in {folder}", "read-only")
    assert ".x.gguf." not in line and "probe" not in line


def test_q8_0_fallback_to_f16_is_noted(gguf_models, tmp_path):
    out = tmp_path / "h80.gguf"
    done = kvconvert("export-gguf", "--src", gguf_models["h80"], "--out", out, "--outtype", "q8_0")
    assert done.returncode == 0, done.stderr
    notes = [ln for ln in done.stderr.splitlines() if ln.startswith("note: --outtype q8_0")]
    assert len(notes) == 1 and "13 of 20 tensors are F16 instead" in notes[0] and "rows of 80 values" in notes[0]


# ------------------------------------------------------------------ mistyped paths

@pytest.mark.parametrize("command", ["calibrate", "export-gguf", "mla"])
def test_a_mistyped_relative_path_is_no_such_folder_not_a_hub_id(faults, tmp_path, command):
    """`--src g1/typo` beside a folder g1 (and a path of three parts) is a local path that is missing, not a hub id
    fetched with a "no network?" guess."""
    from test_faults import TINY_CAL, TINY_MLA

    (tmp_path / "g1").mkdir()
    for src in ("g1/typo", "models/g1/typo"):
        args = {"calibrate": ["calibrate", "--src", src, *TINY_CAL, "--out", "out"],
                "export-gguf": ["export-gguf", "--src", src, "--out", "out.gguf"],
                "mla": ["mla", "--src", src, *TINY_MLA, "--out", "out"]}[command]
        line = refused(kvconvert_in(tmp_path, *args, env=dict(ENV, HF_HUB_OFFLINE="1")), None,
                       f"{src}: no such folder")
        assert "hub" not in line.split(";")[0] or "hub id is org/name" in line
        assert "cannot fetch" not in line and "no network" not in line
    assert "is a folder here" in refused(kvconvert_in(tmp_path, *args[:2], "g1/typo", *args[3:]), None)
    assert not [p for p in tmp_path.iterdir() if p.name != "g1"]  # nothing written


# ------------------------------------------------------------------ reports and what was asked of them

def test_sigterm_in_the_llama_cpp_phase_leaves_a_report_gate_refuses(gguf_models, tmp_path):
    """SIGTERM once the runtime's suite is written and llama.cpp's phase has begun: report.json records that llama.cpp
    was asked for and did not finish, and gate does not pass the runtime's numbers alone."""
    import json
    import signal

    needs_llama_cpp()
    out = tmp_path / "report"
    args = ["validate", "--source", gguf_models["tiny"], "--candidate", gguf_models["tiny"], "--engine", "llamacpp",
            "--kv-dtype", "q8_0", "--suite", "smoke", "--no-progress", "--threads", "1", "--out", out]
    proc = subprocess.Popen([sys.executable, "-m", "kvconvert.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("llama.cpp: exporting"):
            proc.send_signal(signal.SIGTERM)
            break
    proc.communicate(timeout=300)
    assert proc.returncode != 0, "".join(seen)
    assert any(line.startswith("llama.cpp: exporting") for line in seen), "".join(seen)
    report = json.loads((out / "report.json").read_text())
    assert "did not finish" in report["engines"]["llamacpp"]["pending"]
    assert "Not computed: validate --engine llamacpp was asked for" in (out / "report.md").read_text()
    gate = kvconvert("gate", "--report", out, "--policy", ROOT / "recipes" / "gates" / "smoke.yaml")
    refused(gate, None, "validate --engine llamacpp has no result in this report", "did not finish")


@pytest.mark.parametrize("args", [
    ["validate", "--source", "smollm2-135m", "--candidate", "smollm2-135m", "--llamacpp-rotation",
     "--no-llamacpp-rotation", "--suite", "smoke"],
    ["mla", "--src", "smollm2-135m", "--no-refit-o-proj", "--refit-o-proj", "--rank", "64"],
])
def test_both_ways_of_an_on_off_flag_are_refused(tmp_path, args):
    """--x --no-x together: refused (the last one used to win silently); either one alone is taken."""
    out = tmp_path / "out"
    flag = next(a for a in args if a.startswith("--no-"))
    refused(kvconvert(*args, "--out", out), out, f"--{flag[5:]} and {flag} were both given: pass one of them")


def test_one_way_of_an_on_off_flag_is_taken():
    from kvconvert.commands.validate import validate_cmd

    for given, value in (([], None), (["--llamacpp-rotation"], True), (["--no-llamacpp-rotation"], False),
                         (["--no-llamacpp-rotation", "--no-llamacpp-rotation"], False)):
        ctx = validate_cmd.make_context("validate", ["--source", "s", "--candidate", "c", "--out", "o", *given])
        assert ctx.params["llamacpp_rotation"] is value


# ------------------------------------------------------------------ inspect and the checks of the other commands

@pytest.mark.parametrize("fault, says", [("no_hidden", "hidden_size is missing"),
                                         ("transposed", "it is stored transposed"),
                                         ("wrong_size", "v_proj.weight' has shape [32, 32]"),
                                         ("kv0", "num_key_value_heads is 0; it must be a positive integer")])
def test_inspect_notes_what_every_other_command_refuses(input_faults, fault, says):
    """inspect still describes the folder (exit 0) and notes, in generate's own words, why the others refuse it."""
    folder = input_faults[fault]
    done = kvconvert("inspect", folder)
    assert done.returncode == 0, done.stderr
    other = error_line_of(kvconvert("generate", "--model", folder, "--prompt", "x", "--max-new-tokens", "1"))
    assert says in other
    assert f"note          kvconvert's other commands refuse this folder: {other}" in done.stdout.splitlines()
    if fault == "kv0":  # 0 is stated and wrong, not missing
        assert "has no num_key_value_heads" not in done.stdout and "says num_key_value_heads 0" in done.stdout
    assert "kvconvert's other commands refuse" not in kvconvert("inspect", input_faults["no_kv_mha"]).stdout


def error_line_of(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    return next(line for line in done.stderr.splitlines() if line.startswith("error: "))[len("error: "):]


def test_a_v_proj_of_other_heads_than_k_proj_is_damage_not_a_config_to_change(faults, tmp_path):
    """v_proj with 1 KV head where k_proj and config.json have 2: the fix is the tensor, not "num_key_value_heads": 1."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "v1"
    shutil.copytree(faults["base"], folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(16, 64)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    line = error_line_of(kvconvert("generate", "--model", folder, "--prompt", "x", "--max-new-tokens", "1"))
    assert ("holds 1 KV heads of head_dim 16, but the same layer's k_proj holds 2 (as config.json says): the tensor "
            "is damaged or from another checkpoint") in line
    assert '"num_key_value_heads": 1' not in line
    assert line in kvconvert("inspect", folder).stdout
