"""Silent wrong results and lost files a new user hit, through the real CLI in a subprocess. Each ran to the
end (exit 0) with a wrong number, another model's result or a user's file replaced; each is now one `error:`
line (exit 2) before any work, a correct result, or a warning with a flag to go on anyway.
docs/reliability.md's table lists the same cases."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
from eval_fixtures import gen_records, make_report
from test_faults import kvconvert, refused

PLAN_TOKENS = ["--calib-tokens", "512"]  # pipeline --kv-budget: the plan's conversions and KV calibration
LAYERWISE = ["--layerwise-tokens", "1024", "--layerwise-window", "128", "--layerwise-steps", "2"]
DISTILL = ["--distill-tokens", "2048", "--distill-seq-len", "128"]  # 16 steps of 128 tokens


def _plan(src: Path, budget: str, target: str, out: Path):
    """`kvconvert plan` with the options `pipeline --kv-budget ... --calib-tokens 512` plans with."""
    done = kvconvert("plan", "--src", src, "--kv-budget", budget, "--target", target, *PLAN_TOKENS,
                     "--kv-calib-tokens", "512", "--out", out)
    assert done.returncode == 0, done.stderr
    return done


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ pipeline --kv-budget and its plan

def test_a_plan_made_for_other_weights_is_refused_and_the_pipelines_flags_reach_the_stages(faults, tmp_path):
    """OUT/plan made for model B, then `pipeline --src A --kv-budget` into OUT: the plan was reused with no word,
    built a candidate never measured on A and the gate passed. Now refused (the plan records its source's
    fingerprint); for B it is reused, and --suite smoke and --calib-tokens 512 reach the stages (the plan path
    used to run the quick suite and 16384 calibration tokens whatever they said)."""
    out, other = tmp_path / "O", faults["other"]
    _plan(other, "25%", "any", out / "plan")
    made = _files(out / "plan")
    args = ["--kv-budget", "25%", "--target", "any", *PLAN_TOKENS, "--suite", "smoke", "--out", out]
    done = kvconvert("pipeline", "--src", faults["base"], *args)
    refused(done, None, f"{out / 'plan'}: the plan there was made for other weights ({other}, fingerprint ",
            f"{faults['base']} is ", "pass --overwrite to plan again")
    assert _files(out / "plan") == made and sorted(p.name for p in out.iterdir()) == ["plan"]

    again = kvconvert("pipeline", "--src", other, *args)
    assert again.returncode == 0, again.stderr
    assert f"== plan: reusing {out / 'plan'}, made for {other}'s weights" in again.stderr
    log = {s["stage"]: s for s in json.loads((out / "pipeline.json").read_text())["stages"]}
    assert "--suite smoke" in log["validate"]["command"] and "--calib-tokens 512" in log["calibrate"]["command"]
    assert json.loads((out / "report" / "report.json").read_text())["suite"]["name"] == "smoke"


def test_a_hand_edited_plan_recipe_is_refused_with_what_the_target_serves(faults, tmp_path):
    """The plan chose the source with an fp8 cache for --target vllm; its recipe.yaml edited to nvfp4 used to be
    built and shipped (vLLM serves no NVFP4 cache here) while plan.json still said fp8."""
    out = tmp_path / "O"
    _plan(faults["base"], "55%", "vllm", out / "plan")
    recipe = out / "plan" / "recipe.yaml"
    assert "kv_dtype: fp8" in recipe.read_text()
    recipe.write_text(recipe.read_text().replace("kv_dtype: fp8", "kv_dtype: nvfp4"))
    done = kvconvert("pipeline", "--src", faults["base"], "--kv-budget", "55%", "--target", "vllm", *PLAN_TOKENS,
                     "--out", out)
    refused(done, None, f"{recipe} builds the source with a nvfp4 KV cache, which --target vllm does not serve "
                        "(served by: tensorrt-llm, kvconvert",
            f'{recipe} was edited since the plan chose it (calibrate.kv_dtype "fp8" -> "nvfp4")',
            f"`kvconvert pipeline --recipe {recipe} --out OTHER`")
    assert not (out / "source-nvfp4").exists() and not (out / "pipeline.json").exists()


@pytest.mark.parametrize("command", ["plan", "pipeline"])
def test_a_full_budget_is_refused_up_front_with_a_budget_that_builds_something(faults, tmp_path, command):
    """--kv-budget 100%: the plan chose the source as it is (nothing to build), and the pipeline then refused the
    plan's own recipe, as did the command the plan printed."""
    out = tmp_path / "O"
    done = kvconvert(command, "--src", faults["base"], "--kv-budget", "100%", "--out", out)
    refused(done, out, "--kv-budget '100%': 100% is the source's own bf16 KV cache",
            "Give a budget below 100%, e.g. 50% (the source's KV cache in fp8)")


# ------------------------------------------------------------------ files that are not ours

def test_plan_and_pipeline_leave_the_users_files_alone(faults, tmp_path):
    """`plan --out DIR` replaced the user's recipe.yaml and plan.md (and had no --overwrite); `pipeline --out DIR`
    replaced pipeline.json and report/report.md. Both refuse now, as mla and calibrate refuse an existing --out."""
    mine = tmp_path / "mine"
    (mine / "report").mkdir(parents=True)
    for name, text in {"recipe.yaml": "my recipe\n", "plan.md": "my notes\n", "pipeline.json": '{"mine": 1}\n',
                       "report/report.md": "my report\n"}.items():
        (mine / name).write_text(text)
    before = _files(mine)
    plan = kvconvert("plan", "--src", faults["base"], "--kv-budget", "50%", "--target", "any", "--out", mine)
    refused(plan, None, f"{mine / 'recipe.yaml'}: output exists; choose another --out or pass --overwrite")
    pipeline = kvconvert("pipeline", "--src", faults["base"], "--no-mla", "--suite", "smoke", "--out", mine)
    refused(pipeline, None, f"{mine}: output exists; choose another --out or pass --overwrite")
    assert _files(mine) == before
    assert "--overwrite" in kvconvert("plan", "--help").stdout


# ------------------------------------------------------------------ heal

def _heal(student: Path, teacher: Path, out: Path, *extra):
    return kvconvert("heal", "--student", student, "--teacher", teacher, "--no-progress", "--out", out, *extra)


def test_heal_against_other_weights_is_refused_unless_allowed(faults, silent_faults, tmp_path):
    """The student's manifest records base; a teacher with the same shapes, embeddings and MLPs but other attention
    weights healed it without a word. Refused now, naming both; --allow-other-teacher goes on, with a note."""
    student, teacher, out = silent_faults["student"], silent_faults["retuned"], tmp_path / "H"
    done = _heal(student, teacher, out, "--recipe", "layerwise", *LAYERWISE)
    refused(done, out, f"{student} was converted from {faults['base']} (weights fingerprint ",
            f"but --teacher {teacher} holds other weights (fingerprint ", "--allow-other-teacher")
    allowed = _heal(student, teacher, out, "--recipe", "layerwise", *LAYERWISE, "--allow-other-teacher")
    assert allowed.returncode == 0, allowed.stderr
    notes = json.loads((out / "heal_report.json").read_text())["notes"]
    assert any(n.startswith(f"--allow-other-teacher: {student} was converted from") for n in notes)
    # the layer-wise stage says its size before it starts and each layer's ETA
    assert "heal_layerwise: 2 layers x 2 Adam steps of 1 x 128 tokens (4 steps)" in allowed.stderr
    assert "heal_layerwise: layer 1/2 (" in allowed.stderr


def test_heal_resumed_with_other_options_says_so_and_names_the_total(faults, silent_faults, tmp_path):
    """A heal stopped at step 6 of 16, rerun with another lr, restarted from step 0 silently; its progress line
    said "stopped at step 6/6"."""
    out = tmp_path / "H"
    args = (silent_faults["student"], faults["base"], out, "--recipe", "layerwise+distill", *LAYERWISE, *DISTILL)
    first = _heal(*args, "--max-steps", "6")
    assert first.returncode == 0, first.stderr
    assert "stopped at step 6/16" in first.stdout
    changed = _heal(*args, "--distill-lr", "0.001")
    refused(changed, None, "saved progress of an interrupted heal was made with other options "
                           "(heal_distill.lr 0.0005 -> 0.001)", "pass --overwrite (or --restart) to discard it")
    assert not out.exists()
    resumed = _heal(*args, "--max-steps", "8")
    assert resumed.returncode == 0, resumed.stderr
    assert "heal_distill: resuming at step 6/16" in resumed.stderr and "stopped at step 8/16" in resumed.stdout


def test_layerwise_steps_have_a_sane_bound(faults, silent_faults, tmp_path):
    """heal_layerwise.steps 10^9 was accepted with no plan or ETA (years of Adam steps)."""
    out = tmp_path / "H"
    done = _heal(silent_faults["student"], faults["base"], out, "--recipe", "layerwise", "--layerwise-steps",
                 str(10 ** 9))
    refused(done, out, "--layerwise-steps: Input should be less than or equal to 10000")


@pytest.mark.parametrize("case", ["random bytes", "missing file"])
def test_heal_data_that_is_not_text_or_not_there(faults, silent_faults, tmp_path, case):
    """A .txt of random bytes healed on U+FFFD characters (errors="replace", no note); a missing data file was
    taken for a datasets id and asked for `pip install datasets`."""
    data, out = tmp_path / "data" / "junk.txt", tmp_path / "H"
    if case == "random bytes":
        data.parent.mkdir()
        data.write_bytes(random.Random(0).randbytes(64 * 1024))
    done = _heal(silent_faults["student"], faults["base"], out, "--recipe", "layerwise", *LAYERWISE,
                 "--layerwise-data", data)
    expected = ((f"{data}: ", "invalid UTF-8 sequences in its bytes 0-", "not UTF-8 text") if case == "random bytes"
                else (f"{data}: no such file or folder",))
    line = refused(done, out, *expected)
    assert "pip install" not in line


def test_a_few_undecodable_bytes_are_read_with_a_warning(tmp_path, capsys):
    """The data reader's check (kvconvert.text_sources.utf8_piece): one Latin-1 byte in a UTF-8 text is read
    as U+FFFD and said once; the heal above refuses a file that is mostly undecodable."""
    from kvconvert.data import load_text

    text = tmp_path / "notes.txt"
    text.write_bytes(("the value of the function " * 400).encode() + b"caf\xe9\n")
    assert load_text(str(text)).count("\ufffd") == 1
    assert f"warning: {text}: 1 invalid UTF-8 sequences in its bytes 0-" in capsys.readouterr().err


# ------------------------------------------------------------------ recipes, gates, validate, inspect

def test_a_bool_is_not_a_count(faults, tmp_path):
    """A recipe's `calib_tokens: true` ran as 1 token and was printed as `--calib-tokens 1`."""
    recipe, out = tmp_path / "r.yaml", tmp_path / "O"
    recipe.write_text("calibrate:\n  kv_dtype: fp8\n  calib_tokens: true\n")
    done = kvconvert("pipeline", "--src", faults["base"], "--recipe", recipe, "--out", out)
    refused(done, out, f"{recipe}: invalid recipe: calibrate.calib_tokens: true is a bool, not a count; give a "
                       "whole number")
    assert "--calib-tokens 1" not in done.stdout + done.stderr


def test_a_required_metric_is_checked(tmp_path):
    """A policy requiring ruler_accuracy_drop without a threshold for it passed a report without RULER
    (recipes/gates/default.yaml: a required, unmeasured metric fails)."""
    report = tmp_path / "report.json"
    report.write_text(json.dumps(make_report({"passkey": gen_records([1.0] * 4, [1.0] * 4)})))
    policy = tmp_path / "p.yaml"
    policy.write_text("require: [ruler_accuracy_drop]\nthresholds:\n  passkey_accuracy_drop: 10\n")
    refused(kvconvert("gate", "--report", report, "--policy", policy), None,
            "require lists ruler_accuracy_drop with no threshold, so the gate would never check it")
    policy.write_text("require: [ruler_accuracy_drop]\nthresholds:\n  passkey_accuracy_drop: 10\n"
                      "  ruler_accuracy_drop: 10\n")
    gated = kvconvert("gate", "--report", report, "--policy", policy)
    assert gated.returncode == 1 and "gate FAILED: ruler_accuracy_drop" in gated.stdout


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_a_longbench_dir_that_is_missing_is_refused_like_an_empty_one(faults, tmp_path, folder):
    """--longbench-dir /nonexistent skipped LongBench and exited 0; an empty folder exited 2."""
    data, out = tmp_path / "lb", tmp_path / "R"
    if folder == "empty":
        data.mkdir()
    done = kvconvert("validate", "--source", faults["base"], "--candidate", faults["base"], "--suite", "smoke",
                     "--longbench-dir", data, "--out", out)
    refused(done, out, "LongBench-mini data not found at" if folder == "missing" else "task file missing", str(data))


def test_validate_engine_vllm_that_cannot_run_fails(faults, silent_faults, tmp_path):
    """--engine vllm with a python without vLLM, or a vLLM that fails, exited 0 with the runtime's numbers alone
    (report.json said nothing; only report.md wrote "Not computed")."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this python has vllm: it cannot stand for one without it")
    base, out = faults["base"], tmp_path / "R"
    args = ["validate", "--source", base, "--suite", "smoke", "--engine", "vllm", "--out", out]
    refused(kvconvert(*args, "--candidate", base, "--vllm-python", sys.executable), out,
            f"{sys.executable} has no vllm package")
    # a vllm that is installed but broken: the suite runs, vLLM's worker fails, report.json records it, exit 2
    broken = tmp_path / "broken"
    (broken / "vllm").mkdir(parents=True)
    (broken / "vllm" / "__init__.py").write_text("raise ImportError('this vLLM build is broken')\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={broken} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    failed = kvconvert(*args, "--candidate", base, "--vllm-python", python)
    refused(failed, None, "--engine vllm failed, no vLLM numbers", "vllm does not import",
            "this vLLM build is broken")
    saved = json.loads((out / "report.json").read_text())
    assert "this vLLM build is broken" in saved["engines"]["vllm"]["error"]
    assert any(n.startswith("--engine vllm failed") for n in saved["notes"])
    # a candidate whose MLA shape vLLM refuses at load: refused before the suite
    refused(kvconvert(*args[:-1], tmp_path / "R2", "--candidate", silent_faults["student"], "--vllm-python", python),
            tmp_path / "R2", "caches an MLA latent of 16+8 = 24 values, which vLLM refuses")


def test_inspect_reads_the_kv_heads_from_the_weights(silent_faults):
    """No num_key_value_heads in config.json over tensors of 2 KV heads: inspect said MHA, 4 KV heads and
    512 B/token; the weights cache 256."""
    folder = silent_faults["no_kv"]
    done = kvconvert("inspect", folder, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["attention_kind"], report["num_key_value_heads"]) == ("GQA", 2)
    assert report["kv_bytes_per_token"]["bf16"] == 256
    assert any('set "num_key_value_heads": 2 in config.json' in n for n in report["notes"])
    text = kvconvert("inspect", folder).stdout
    assert "4 heads, 2 KV heads" in text and "bf16 256 B" in text and "512 B" not in text
