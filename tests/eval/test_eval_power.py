"""Power of the default gate on the embedded model (SmolLM2-135M-Instruct, bundled runtime): every metric the
default policy gates FAILs a known-damaged cache and PASSes the source against itself.

The damaged candidate is the source itself with llama.cpp's q4_0 cache and its Hadamard rotation disabled
(LLAMA_ATTN_ROT_DISABLE=1, validate's --no-llamacpp-rotation): KL about 0.15 nats/token on the essays. The suite
is a small cut of the quick suite (3 essay windows of 256 tokens, 5 needle prompts of 512 tokens, 3 LongBench
tasks x 2); the source runs once for both tests (a shared results folder, as the CLI keeps one), and the
source against itself then comes from the cache (same fingerprint), so the pair costs one source and one
candidate pass.
"""

import dataclasses

import pytest

from kvconvert.eval import gate as G
from kvconvert.eval.suites import SUITES
from kvconvert.eval.validate import ValidateOptions, run_validate

POWER = dataclasses.replace(
    SUITES["quick"], name="power", ppl_windows=3, ppl_window_len=256,
    passkey_lengths=(512,), passkey_depths=(0.0, 0.5, 1.0), niah_lengths=(512,), niah_depths=(0.25, 0.75),
    long_lengths=(), long_window_len=0,
    longbench_tasks=("trec", "2wikimqa", "triviaqa"), longbench_per_task=2, longbench_context=512, longbench_max_new=8)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("source_results")


def _validate(smollm2_path, out, shared, **options) -> dict:
    opts = ValidateOptions(engine="runtime", **options)
    return run_validate(str(smollm2_path), str(smollm2_path), out, opts, spec=POWER, progress=False, threads=2,
                        shared=shared)


@pytest.fixture(scope="module")
def default_policy():
    from pathlib import Path

    from kvconvert.resources import find_policy

    return G.load_policy(Path(find_policy("default")))


@pytest.mark.slow
def test_default_gate_fails_q4_0_without_rotation_on_every_metric(tmp_path, smollm2_path, default_policy, shared):
    report = _validate(smollm2_path, tmp_path / "damaged", shared, kv_dtype="q4_0", llamacpp_rotation=False)
    rows = G.evaluate(report, default_policy)
    assert {r["metric"]: r["status"] for r in rows} == {m: "fail" for m in default_policy.require}, rows
    assert report["metrics"]["kl_mean"]["candidate"] > 0.1  # the damage this test is about
    # the accuracies the default policy no longer gates: reported, and what they could detect on this size
    assert "passkey_accuracy" in report["metrics"] and report["estimates"]["passkey_accuracy_drop"]["detectable"] > 50


@pytest.mark.slow
def test_default_gate_passes_the_source_against_itself(tmp_path, smollm2_path, default_policy, shared):
    report = _validate(smollm2_path, tmp_path / "same", shared)
    rows = G.evaluate(report, default_policy)
    assert {r["metric"]: r["status"] for r in rows} == {m: "pass" for m in default_policy.require}, rows
    assert G.gate_summary(rows, default_policy).startswith("gate passed: PASS on every gated metric")
