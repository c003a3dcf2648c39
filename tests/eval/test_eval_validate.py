"""End-to-end `kvconvert validate`: tiny random models (fast) and SmolLM2 (slow).

Fast: the whole smoke suite on a tiny Llama vs itself gives exactly zero deltas; reports,
charts and cache are written; a rerun resumes from the cache; a torn cache line is recomputed;
bad inputs fail with clear errors. Slow: SmolLM2 vs itself reports exactly zero deltas with
every sample recomputed, and a clearly degraded SmolLM2 (attention o_proj x 0.5) fails the gate.
"""

import dataclasses
import json
import shutil

import pytest
from eval_fixtures import save_tiny_model, train_tokenizer

from kvconvert.commands.main import main
from kvconvert.errors import KVConvertError
from kvconvert.eval.suites import SUITE_VERSION, SUITES
from kvconvert.eval.validate import ValidateOptions, run_validate, window_stats

# The smoke suite with lengths that fit the tiny 512-token BPE (it needs ~2x the tokens of a
# real tokenizer for the same prompt templates).
TINY = dataclasses.replace(SUITES["smoke"], name="tiny", passkey_lengths=(512,), niah_lengths=(512,),
                           ruler_lengths=(512,), longbench_context=512)


def validate(source, candidate, out, suite=TINY, resume=True, **kw) -> dict:
    """run_validate with the transformers engine, a named suite or a SuiteSpec, no progress bars."""
    named = {"suite": suite} if isinstance(suite, str) else {}
    opts = ValidateOptions(**{"engine": "transformers", **named, **kw})
    return run_validate(str(source), str(candidate), out, opts, spec=None if named else suite, resume=resume,
                        progress=False, threads=1)


def assert_all_deltas_zero(report: dict) -> None:
    for name, metric in report["metrics"].items():
        assert metric["delta"] == 0.0, name
        assert metric["source"] == metric["candidate"], name
    assert report["metrics"]["kl_mean"]["candidate"] == 0.0
    for name, est in report["estimates"].items():
        if est["no_interval"] is not None:  # one sample per task (LongBench in smoke): no interval is claimed
            assert (est["point"], est["low"], est["high"]) == (0.0, None, None), name
            continue
        assert (est["point"], est["low"], est["high"]) == (0.0, 0.0, 0.0), name


def test_window_stats_against_torch_reference():
    """NLL sums and token KL(source || candidate) vs torch's cross_entropy and kl_div (fp64)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    ids = torch.randint(0, 50, (300,))  # > 256 rows: exercises the chunking
    src, cand = torch.randn(300, 50) * 3, torch.randn(300, 50) * 3
    got = window_stats(src, cand, ids)
    assert got["n_tokens"] == 299
    ref_nll = F.cross_entropy(src[:-1].double(), ids[1:], reduction="sum")
    assert got["source_nll"] == pytest.approx(float(ref_nll), rel=1e-12)
    assert got["candidate_nll"] == pytest.approx(float(F.cross_entropy(cand[:-1].double(), ids[1:], reduction="sum")),
                                                 rel=1e-12)
    ref_kl = F.kl_div(F.log_softmax(cand[:-1].double(), -1), F.log_softmax(src[:-1].double(), -1),
                      reduction="sum", log_target=True)
    assert got["kl"] == pytest.approx(float(ref_kl), rel=1e-10)
    same = window_stats(src, src.clone(), ids)
    assert same["kl"] == 0.0 and same["source_nll"] == same["candidate_nll"]


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("tiny_report")
    return out, validate(tiny_llama, tiny_llama, out, resume=False)


def test_tiny_model_vs_itself_reports_exact_zero_deltas(tiny_report):
    out, report = tiny_report
    assert report["suite"]["name"] == "tiny" and report["suite"]["version"] == SUITE_VERSION
    assert_all_deltas_zero(report)
    expected = {"perplexity", "passkey", "niah", "ruler/niah_single_2", "ruler/vt"}
    assert expected <= set(report["samples"])
    assert report["cache"]["hits"] == 0  # resume=False: the candidate was really recomputed
    for name in ("report.json", "report.md", "niah_candidate.png", "niah_delta.png", "passkey_candidate.png"):
        assert (out / name).is_file(), name
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["metrics"] == report["metrics"]
    record = report["samples"]["passkey"][0]
    assert set(record) >= {"id", "meta", "answers", "prompt_tokens", "source", "candidate"}
    assert set(record["candidate"]) == {"tokens", "text", "score", "answer_nll", "answer_tokens"}
    assert record["candidate"]["answer_tokens"] > 0 and record["candidate"]["answer_nll"] > 0
    assert "ruler/vt" in report["samples"] and "answer_nll" not in report["samples"]["ruler/vt"][0]["source"]
    assert report["estimates"]["answer_nll_increase"]["n"] == sum(
        len(report["samples"][t]) for t in report["samples"] if t in ("passkey", "niah") or t.startswith("longbench/"))


@pytest.mark.parametrize("engine", ["transformers", "runtime"])
def test_answer_nll_is_the_teacher_forced_likelihood_of_the_reference(tiny_llama, engine):
    """The rows that predict the reference tokens, not one off: checked against a plain forward pass. The runtime
    scores the answer over its prompt's cached K/V (fp32 cache here: equal to 1e-5)."""
    import torch

    from kvconvert.eval.runner import LazyRunner, SampleRequest

    prompt, reference = tuple(range(5, 40)), (11, 12, 13)
    plain = LazyRunner(tiny_llama, "transformers")
    logp = torch.log_softmax(plain.logits(torch.tensor(prompt + reference)).double(), -1)
    expected = -sum(float(logp[34 + i, tok]) for i, tok in enumerate(reference))  # row t predicts token t + 1
    runner = LazyRunner(tiny_llama, engine, kv_dtype="fp32" if engine == "runtime" else "auto")
    (result,) = runner.run_samples([SampleRequest(prompt, 4, (), 0, reference)])
    assert result.answer == {"nll": pytest.approx(expected, rel=1e-5), "tokens": 3}
    assert len(result.tokens) == 4


def test_rerun_resumes_from_cache_and_recomputes_torn_lines(tmp_path, tiny_report, tiny_llama):
    out, first = tiny_report
    resumed = validate(tiny_llama, tiny_llama, out)
    assert resumed["cache"]["misses"] == 0 and resumed["cache"]["hits"] > 0
    assert resumed["metrics"] == first["metrics"]
    # simulate a run killed while writing: the last sample's result is a torn line
    cache_file = next((out / "cache").glob("*__passkey.jsonl"))
    lines = cache_file.read_text().splitlines()
    last_id = json.loads(lines[-1])["id"]
    kept = [line for line in lines if json.loads(line)["id"] != last_id]
    cache_file.write_text("\n".join(kept + [lines[-1][: len(lines[-1]) // 2]]))  # no final newline
    again = validate(tiny_llama, tiny_llama, out)
    assert again["cache"]["misses"] == 1  # only the torn sample is recomputed (then shared) ...
    assert again["metrics"] == first["metrics"]  # ... deterministically
    appended = cache_file.read_text().splitlines()
    assert len(appended) == len(kept) + 2  # the new result starts on its own line
    assert json.loads(appended[-1])["id"] == last_id


def test_tokenizer_mismatch_is_refused(tmp_path, tiny_llama, tiny_tokenizer):
    other = save_tiny_model(tmp_path / "m", len(tiny_tokenizer))
    train_tokenizer(other, vocab_size=400)
    with pytest.raises(KVConvertError, match="tokenizers differ"):
        validate(tiny_llama, other, tmp_path / "rep")


@pytest.mark.parametrize("suite", ["smoke", "standard"])
def test_missing_longbench_data_refused_before_any_model_runs(tmp_path, tiny_llama, suite):
    """A --longbench-dir that does not exist used to skip LongBench in smoke and quick (exit 0), where an empty
    folder was refused: both are refused now, in every suite that runs LongBench, and no report is written."""
    missing = tmp_path / "no-longbench"
    with pytest.raises(KVConvertError, match=f"LongBench-mini data not found at {missing}"):
        validate(tiny_llama, tiny_llama, tmp_path / "rep", longbench_dir=missing, suite=suite)
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("candidate, extra", [("missing", []), ("tiny", ["--kv-dtype", "fp8"])])
def test_validate_cli_errors(tmp_path, tiny_llama, candidate, extra, run_main):
    """A missing candidate folder, and FP8 KV without calibrated scales, exit 2."""
    folder = tiny_llama if candidate == "tiny" else tmp_path / candidate
    code, _ = run_main(["validate", "--source", tiny_llama, "--candidate", folder, "--out", tmp_path / "r",
                        "--engine", "transformers", *extra])
    assert code == 2


# --------------------------------------------------------------------------- SmolLM2 (slow)

@pytest.fixture(scope="module")
def smollm2_smoke(tmp_path_factory, smollm2_path):
    out = tmp_path_factory.mktemp("smollm2_smoke")
    return out, validate(smollm2_path, smollm2_path, out, resume=False, suite="smoke")


@pytest.mark.slow
def test_smollm2_vs_itself_exact_zero_deltas(smollm2_smoke):
    _, report = smollm2_smoke
    assert_all_deltas_zero(report)
    assert report["cache"]["hits"] == 0
    assert 20 < report["metrics"]["perplexity"]["source"] < 80  # a working model, not noise
    assert report["metrics"]["passkey_accuracy"]["source"] > 0


@pytest.mark.slow
def test_degraded_smollm2_fails_the_gate(tmp_path, smollm2_path, smollm2_smoke, capsys):
    from kvconvert.checkpoint import CheckpointReader, CheckpointWriter

    degraded = tmp_path / "degraded"
    with CheckpointReader(smollm2_path) as reader, CheckpointWriter(degraded, source="test: o_proj x 0.5") as writer:
        for name in reader.keys():
            tensor = reader.get(name)
            writer.add(name, tensor * 0.5 if name.endswith("self_attn.o_proj.weight") else tensor)
        writer.write_config(reader.config)
        writer.copy_tokenizer(smollm2_path)
    source_out, _ = smollm2_smoke
    out = tmp_path / "report"
    shutil.copytree(source_out / "cache", out / "cache")  # the source's results are reused
    report = validate(smollm2_path, degraded, out, suite="smoke")
    assert report["metrics"]["perplexity"]["delta_pct"] > 50
    policy = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "recipes" / "gates" / "default.yaml")
    with pytest.raises(SystemExit) as info:
        main(["gate", "--report", str(out / "report.json"), "--policy", policy])
    assert info.value.code == 1
    assert "perplexity_increase_pct" in capsys.readouterr().out


def test_the_source_is_measured_once_for_every_candidate(tmp_path, tiny_llama, tiny_tokenizer, tiny_tokenizer_dir):
    """With a shared folder (the pipeline's and the CLI's KVCONVERT_HOME/validate), a second candidate against
    the same source reads the source's window logits and generation results kept by the first run, and
    reports exactly what a run without it reports; another source reuses nothing."""
    first, second = (save_tiny_model(tmp_path / name, len(tiny_tokenizer), seed=seed, tokenizer_dir=tiny_tokenizer_dir)
                     for name, seed in (("first", 1), ("second", 2)))
    shared = tmp_path / "shared"
    opts = ValidateOptions(engine="transformers")

    def run(source, candidate, out, shared_folder=shared):
        return run_validate(str(source), str(candidate), tmp_path / out, opts, spec=TINY, progress=False, threads=1,
                            shared=shared_folder)

    assert not any("earlier run" in n for n in run(tiny_llama, first, "a")["notes"])
    assert list((shared / "logits").glob("*/*.safetensors")) and list((shared / "cache").glob("*.jsonl"))
    reused = run(tiny_llama, second, "b")
    note = next(n for n in reused["notes"] if "earlier run" in n)
    gen_samples = sum(len(v) for k, v in reused["samples"].items() if k != "perplexity")
    answered = reused["estimates"]["answer_nll_increase"]["n"]
    assert f"{TINY.ppl_windows} essay windows, {gen_samples} samples and {answered} answer likelihoods" in note
    assert reused["metrics"] == run(tiny_llama, second, "c", None)["metrics"]  # the same numbers as measured afresh
    assert not any("earlier run" in n for n in run(first, second, "d")["notes"])  # another source: nothing reused
