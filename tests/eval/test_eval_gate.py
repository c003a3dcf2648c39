"""Gate decisions on synthetic reports, bootstrap behaviour, policy and report validation, CLI exit codes."""

import json
from pathlib import Path

import numpy as np
import pytest
from eval_fixtures import gen_records, make_report

from kvconvert.commands.main import main
from kvconvert.errors import KVConvertError
from kvconvert.eval import gate as G
from kvconvert.eval.stats import estimate, resample_indices
from kvconvert.eval.suites import SUITE_VERSION

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "gates"


def ppl_records(source_nll: list[float], candidate_nll: list[float], kl: list[float], n: int = 100) -> list[dict]:
    return [{"id": f"w{i}", "n_tokens": n, "source_nll": s, "candidate_nll": c, "kl": k}
            for i, (s, c, k) in enumerate(zip(source_nll, candidate_nll, kl))]


def write_policy(tmp_path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


def policy(tmp_path, thresholds: str, extra: str = "") -> G.Policy:
    return G.load_policy(write_policy(tmp_path, f"{extra}\nthresholds:\n{thresholds}\n"))


def rows_by_metric(rows):
    return {r["metric"]: r for r in rows}


# --------------------------------------------------------------------------- statistics

def test_perplexity_increase_and_kl_hand_worked():
    # 2 windows x 100 tokens: mean NLL 2.0 -> 2.1: ppl ratio exp(0.1) -> +10.517%
    samples = {"perplexity": ppl_records([200.0, 200.0], [210.0, 210.0], [3.0, 5.0])}
    e = estimate(samples, "perplexity_increase_pct")
    assert e.point == pytest.approx(100 * (np.exp(0.1) - 1))
    assert e.source == pytest.approx(np.exp(2.0)) and e.candidate == pytest.approx(np.exp(2.1))
    assert estimate(samples, "kl_mean").point == pytest.approx(8.0 / 200)


def test_bootstrap_interval_contains_point_and_is_reproducible():
    rng = np.random.default_rng(1)
    samples = {"passkey": gen_records([1.0] * 40, list((rng.random(40) < 0.8).astype(float)))}
    a = estimate(samples, "passkey_accuracy_drop", n_boot=1000, seed=5)
    b = estimate(samples, "passkey_accuracy_drop", n_boot=1000, seed=5)
    assert a == b
    assert a.low <= a.point <= a.high and a.high - a.low > 5
    narrow = estimate(samples, "passkey_accuracy_drop", n_boot=1000, seed=5, confidence=0.5)
    assert a.low <= narrow.low <= narrow.high <= a.high


def test_identical_results_give_zero_width_interval():
    samples = {"niah": gen_records([1, 0, 1, 0.5], [1, 0, 1, 0.5])}
    e = estimate(samples, "niah_accuracy_drop")
    assert (e.point, e.low, e.high) == (0.0, 0.0, 0.0)


def test_stratified_resampling_keeps_every_task_count():
    strata = np.array([0, 0, 0, 1, 2, 2])
    idx = resample_indices(strata, 500, np.random.default_rng(0), stratified=True)
    assert idx.shape == (500, 6)
    assert (strata[idx] == strata).all()  # every position is resampled from its own task
    # a task with one sample is always that sample
    assert (idx[:, 3] == 3).all()


def test_longbench_average_is_mean_over_tasks_not_samples():
    samples = {"longbench/a": gen_records([1.0] * 9, [1.0] * 9),  # 9 samples, no drop
               "longbench/b": gen_records([1.0], [0.0])}  # 1 sample, drop 100 points
    e = estimate(samples, "longbench_avg_drop")
    assert e.point == pytest.approx(50.0)  # (0 + 100) / 2 tasks, not 100 / 10 samples
    # task b has one sample: no spread to resample, so no interval (it used to claim [50, 50])
    assert e.low is None and e.high is None and "1 of 2 tasks have 1 sample" in e.no_interval


def test_answer_nll_increase_is_the_mean_paired_delta_over_task_samples():
    def records(src, cand):
        return [{"id": str(i), "source": {"score": 1.0, "answer_nll": a}, "candidate": {"score": 1.0, "answer_nll": b}}
                for i, (a, b) in enumerate(zip(src, cand))]
    samples = {"passkey": records([0.1, 0.2], [0.3, 0.2]), "longbench/trec": records([1.0, 2.0], [1.2, 2.4]),
               "ruler/vt": gen_records([1.0], [0.0])}  # RULER has no reference answer: not pooled
    e = estimate(samples, "answer_nll_increase")
    assert e.n == 4 and e.point == pytest.approx((0.2 + 0.0 + 0.2 + 0.4) / 4)
    assert e.source == pytest.approx(0.825) and e.low <= e.point <= e.high
    assert estimate({"passkey": gen_records([1.0], [1.0])}, "answer_nll_increase") is None  # older records: none


@pytest.mark.parametrize("n", [6, 12, 30])
def test_smallest_detectable_accuracy_drop_is_where_the_interval_clears_zero(n):
    """The closed form agrees with the bootstrap itself: at the printed drop the interval's low end is above 0,
    one flip fewer it is not."""
    mde = estimate({"passkey": gen_records([1.0] * n, [1.0] * n)}, "passkey_accuracy_drop").detectable
    flips = round(mde * n / 100)
    def low(k):
        return estimate({"passkey": gen_records([1.0] * n, [0.0] * k + [1.0] * (n - k))}, "passkey_accuracy_drop",
                        n_boot=20000).low
    assert low(flips) > 0 and low(flips - 1) == 0
    if n == 6:  # the quick suite's 6 passkey trials: only half of them failing can show
        assert mde == 50.0


def test_validate_summary_prints_the_smallest_detectable_degradation(capsys):
    from kvconvert.eval.report import print_summary

    report = make_report({"passkey": gen_records([1.0] * 6, [1.0] * 6),
                          "perplexity": ppl_records([200.0] * 8, [200.0 + i for i in range(8)], [1.0] * 8)})
    report["seconds"] = 1.0
    print_summary(report)
    out = capsys.readouterr().out
    assert "smallest degradation this suite can detect" in out
    assert "passkey_accuracy_drop: 50.00 pp (3 of 6 samples flipping)" in out
    assert "perplexity_increase_pct:" in out and "standard error on 8 samples" in out


# --------------------------------------------------------------------------- gate decisions

def test_gate_passes_identical_and_fails_clear_degradation(tmp_path):
    pol = policy(tmp_path, "  passkey_accuracy_drop: 10\n  perplexity_increase_pct: 5\n  kl_mean: 0.05")
    same = make_report({"passkey": gen_records([1.0] * 20, [1.0] * 20),
                        "perplexity": ppl_records([200.0] * 4, [200.0] * 4, [0.0] * 4)})
    assert {r["status"] for r in G.evaluate(same, pol)} == {"pass"}
    bad = make_report({"passkey": gen_records([1.0] * 20, [0.0] * 16 + [1.0] * 4),
                       "perplexity": ppl_records([200.0] * 4, [260.0, 250.0, 270.0, 255.0], [20.0] * 4)})
    rows = rows_by_metric(G.evaluate(bad, pol))
    assert rows["passkey_accuracy_drop"]["status"] == "fail"
    assert rows["perplexity_increase_pct"]["status"] == "fail"
    assert rows["kl_mean"]["status"] == "fail"


def test_noise_on_few_samples_is_inconclusive_not_fail_but_fails_on_point(tmp_path):
    # 5 samples, one flipped: point drop 20 pp > 10, but the 95% interval reaches 0: it straddles 10.
    report = make_report({"passkey": gen_records([1.0] * 5, [1.0, 1.0, 0.0, 1.0, 1.0])})
    row = G.evaluate(report, policy(tmp_path, "  passkey_accuracy_drop: 10"))[0]
    assert row["point"] == pytest.approx(20.0) and row["low"] == 0.0
    assert row["status"] == "inconclusive" and row["blocks"]  # on_inconclusive defaults to fail
    assert "straddles the threshold 10 (estimate past it)" in row["reason"] and "samples (now 5)" in row["reason"]
    lenient = G.evaluate(report, policy(tmp_path, "  passkey_accuracy_drop: 10", "on_inconclusive: pass"))[0]
    assert lenient["status"] == "inconclusive" and not lenient["blocks"]
    required = policy(tmp_path, "  passkey_accuracy_drop: 10", "on_inconclusive: pass\nrequire: [passkey_accuracy_drop]")
    assert not G.evaluate(report, required)[0]["blocks"]  # measured, undecided: as the policy says (smoke's case)
    one = make_report({"passkey": gen_records([1.0], [0.0])})  # required, and no interval at all: blocks
    assert G.evaluate(one, required)[0]["blocks"]
    point = G.evaluate(report, policy(tmp_path, "  passkey_accuracy_drop: 10", "decide_on: point"))[0]
    assert point["status"] == "fail"
    # with many samples the same 20 pp drop is no longer noise
    many = make_report({"passkey": gen_records([1.0] * 100, ([1.0] * 4 + [0.0]) * 20)})
    assert G.evaluate(many, policy(tmp_path, "  passkey_accuracy_drop: 10"))[0]["status"] == "fail"


def test_three_verdicts_on_the_interval(tmp_path):
    """PASS: the whole interval within the threshold; FAIL: the whole interval past it; INCONCLUSIVE: between."""
    rng = np.random.default_rng(0)
    src = [200.0] * 40
    def kl_report(mean_kl):  # 40 windows x 100 tokens, per-window KL around mean_kl (spread 20%)
        kl = list(100 * mean_kl * (1 + 0.2 * rng.standard_normal(40)))
        return make_report({"perplexity": ppl_records(src, src, kl)})
    verdicts = {k: G.evaluate(kl_report(k), policy(tmp_path, "  kl_mean: 0.05"))[0] for k in (0.02, 0.05, 0.09)}
    assert [verdicts[k]["status"] for k in (0.02, 0.05, 0.09)] == ["pass", "inconclusive", "fail"]
    assert verdicts[0.02]["high"] <= 0.05 < verdicts[0.09]["low"]
    assert verdicts[0.05]["low"] <= 0.05 <= verdicts[0.05]["high"]


def test_samples_to_decide_scales_with_the_squared_width():
    # estimate 4, interval [3, 5], threshold 4.5: the upper half-width 1 must shrink to 0.5 -> 4x the samples
    assert G.samples_to_decide(4.0, 3.0, 5.0, 10, 4.5) == pytest.approx(40.0)
    assert G.samples_to_decide(5.0, 4.0, 6.0, 10, 4.5) == pytest.approx(40.0)  # past it: the lower side
    assert G.samples_to_decide(4.5, 4.0, 5.0, 10, 4.5) == float("inf")


def test_gate_summary_says_which_kind_of_pass(tmp_path):
    straddle = make_report({"passkey": gen_records([1.0] * 5, [1.0, 1.0, 0.0, 1.0, 1.0])})
    clean = make_report({"passkey": gen_records([1.0] * 5, [1.0] * 5)})
    lenient = policy(tmp_path, "  passkey_accuracy_drop: 10", "on_inconclusive: pass")
    assert G.gate_summary(G.evaluate(clean, lenient), lenient).startswith("gate passed: PASS on every gated metric")
    assert G.gate_summary(G.evaluate(straddle, lenient), lenient).startswith(
        "gate passed with INCONCLUSIVE metrics (passkey_accuracy_drop)")
    strict = policy(tmp_path, "  passkey_accuracy_drop: 10")
    assert G.gate_summary(G.evaluate(straddle, strict), strict) == "gate FAILED: passkey_accuracy_drop"


def test_missing_metric_is_na_unless_required(tmp_path):
    report = make_report({"passkey": gen_records([1.0], [1.0])})
    rows = rows_by_metric(G.evaluate(report, policy(tmp_path, "  ruler_accuracy_drop: 5\n  passkey_accuracy_drop: 5")))
    assert rows["ruler_accuracy_drop"]["status"] == "n/a"
    assert "does not run RULER" in rows["ruler_accuracy_drop"]["reason"]
    required = policy(tmp_path, "  ruler_accuracy_drop: 5", "require: [ruler_accuracy_drop]")
    assert G.evaluate(report, required)[0]["status"] == "fail"


def test_metric_the_suite_runs_but_skipped_fails(tmp_path):
    """The quick suite runs LongBench: a report that skipped it (data missing) fails a LongBench threshold,
    required or not (a skipped measurement is no evidence); RULER, which quick does not run, stays n/a."""
    from kvconvert.eval.suites import SUITES

    report = make_report({"passkey": gen_records([1.0], [1.0])})
    report["suite"]["spec"] = SUITES["quick"].as_dict()
    report["skipped"]["longbench"] = "LongBench-mini data not found at /x"
    rows = rows_by_metric(G.evaluate(report, policy(tmp_path, "  longbench_avg_drop: 2\n  ruler_accuracy_drop: 5")))
    assert rows["longbench_avg_drop"]["status"] == "fail"
    assert rows["longbench_avg_drop"]["reason"] == ("the quick suite runs longbench, this report skipped it: "
                                                    "LongBench-mini data not found at /x")
    assert rows["ruler_accuracy_drop"]["status"] == "n/a"


def test_builtin_policy_by_name(tmp_path, monkeypatch):
    """--policy default|smoke|strict (or recipes/gates/NAME.yaml) from any folder: the packaged policy files."""
    monkeypatch.chdir(tmp_path)
    for name in ("default", "strict.yaml", "recipes/gates/smoke.yaml"):
        stem = Path(name).stem
        assert G.load_policy(Path(name)) == G.load_policy(RECIPES / f"{stem}.yaml")


# --------------------------------------------------------------------------- policy validation

def test_shipped_policies_load():
    policies = {name: G.load_policy(RECIPES / f"{name}.yaml") for name in ("default", "strict", "smoke")}
    assert {p.decide_on for p in policies.values()} == {"interval"}
    assert all(v is not None for v in policies["strict"].thresholds.model_dump().values())
    assert policies["strict"].on_inconclusive == "fail" and policies["smoke"].on_inconclusive == "pass"
    gated = {k for k, v in policies["default"].thresholds.model_dump().items() if v is not None}
    assert gated == set(policies["default"].require) == {"perplexity_increase_pct", "kl_mean", "answer_nll_increase"}


@pytest.mark.parametrize("text, message", [
    ("thresholds:\n  perplexity_increase: 5\n",
     "unknown key 'thresholds.perplexity_increase' (allowed here: perplexity_increase_pct, kl_mean"),
    ("thresholds:\n  kl_mean: 0.1\nthreshold_mode: x\n", "unknown key 'threshold_mode'"),
    ("bootstrap: {samples: 1000, level: 0.9}\nthresholds:\n  kl_mean: 0.1\n", "unknown key 'bootstrap.level'"),
    ("thresholds:\n  kl_mean: -1\n", "thresholds.kl_mean"),
    ("description: no thresholds\n", "missing key 'thresholds'"),
    ("thresholds: {}\n", "no thresholds set"),
    ("decide_on: median\nthresholds:\n  kl_mean: 0.1\n", "decide_on"),
    ("decide_on: ci_low\nthresholds:\n  kl_mean: 0.1\n", "decide_on: interval with on_inconclusive: pass"),
    ("on_inconclusive: warn\nthresholds:\n  kl_mean: 0.1\n", "on_inconclusive"),
    ("require: [passkey_acc]\nthresholds:\n  kl_mean: 0.1\n", "unknown metric(s) passkey_acc in require"),
    ("thresholds: [1, 2\n", "not valid YAML"),
    ("- just a list\n", "must be a mapping"),
    (None, "policy file not found"),
])
def test_policy_errors_name_file_and_key(tmp_path, text, message):
    path = write_policy(tmp_path, text) if text is not None else tmp_path / "none.yaml"
    with pytest.raises(KVConvertError) as info:
        G.load_policy(path)
    assert str(path) in str(info.value) and message in str(info.value)


# --------------------------------------------------------------------------- reports and CLI

def test_report_from_other_suite_version_is_refused(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(make_report({"passkey": gen_records([1.0], [1.0])}, version=SUITE_VERSION + 1)))
    with pytest.raises(KVConvertError, match=f"suite version {SUITE_VERSION + 1}.*re-run kvconvert validate"):
        G.load_report(path)
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(KVConvertError, match="not a kvconvert validate report"):
        G.load_report(path)
    with pytest.raises(KVConvertError, match="report not found"):
        G.load_report(tmp_path / "missing")


def run_cli(args) -> int:
    with pytest.raises(SystemExit) as info:
        main(args)
        raise SystemExit(0)
    return info.value.code


def test_gate_cli_exit_codes(tmp_path, capsys):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for folder, cand in ((good, [0.0] * 30), (bad, [0.5] * 30)):
        folder.mkdir()
        answers = [{"id": str(i), "source": {"score": 1.0, "answer_nll": 0.3},
                    "candidate": {"score": 1.0, "answer_nll": 0.3 + c + 0.01 * (i % 3)}} for i, c in enumerate(cand)]
        (folder / "report.json").write_text(json.dumps(make_report({
            "passkey": answers, "perplexity": ppl_records([200.0] * 3, [200.0] * 3, [0.0] * 3)})))
    default = str(RECIPES / "default.yaml")
    assert run_cli(["gate", "--report", str(good / "report.json"), "--policy", default]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "gate passed: PASS on every gated metric" in out
    assert run_cli(["gate", "--report", str(bad), "--policy", default]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "gate FAILED: answer_nll_increase" in out
    assert run_cli(["gate", "--report", str(bad), "--policy", str(tmp_path / "nope.yaml")]) == 2
