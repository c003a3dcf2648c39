"""Gated quantities and their paired bootstrap confidence intervals.

Every gated quantity is a *degradation* of the candidate against the source, computed from the
per-sample results stored in report.json (positive = worse):

    perplexity_increase_pct  100 * (ppl_cand / ppl_src - 1), ppl = exp(sum NLL / sum tokens)
    kl_mean                  sum over tokens of KL(source || candidate) / tokens  (nats/token)
    passkey_accuracy_drop    accuracy_src - accuracy_cand, in percentage points
    niah_accuracy_drop       same, NIAH substring score
    ruler_accuracy_drop      same, all RULER samples pooled
    longbench_avg_drop       mean over tasks of (task score_src - task score_cand), LongBench points
    answer_nll_increase      mean over task samples (passkey, NIAH, LongBench) of the reference answer's
                             NLL per token, candidate minus source (nats/token), teacher-forced

Paired bootstrap: resample *samples* (windows, prompts) with replacement, keeping each sample's
source and candidate results together, recompute the statistic; LongBench resamples within each
task (stratified) so every task keeps its count. The interval is the percentile interval at the
given confidence. Vectorized: index matrices [B, n], fixed seed, so results are reproducible.

No interval without variation to resample: a task (stratum) with one sample resamples to itself
every time, so with one sample per task the bootstrap gives a zero-width "interval" that says
nothing about noise. An interval is reported only when every stratum (all samples, when not
stratified) has at least MIN_SAMPLES_FOR_INTERVAL samples; otherwise low/high are None and
`no_interval` says why, and the gate reports "not enough samples to decide".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from kvconvert.errors import KVConvertError

MIN_SAMPLES_FOR_INTERVAL = 2  # per stratum: one sample has no spread to resample
# LongBench points (0-100): a task on which the source scores below this is left out of longbench_avg_drop. Its
# drop is bounded by the source's own score and its changes are noise around the floor (a 135M model answers
# passage_count or passage_retrieval at random; a damaged cache "improved" such tasks in measurements).
LONGBENCH_FLOOR = 5.0


@dataclass(frozen=True)
class GateMetric:
    """How to get one gated quantity out of a report's per-sample results.

    tasks: predicate on the report's task names whose samples it uses. columns: record -> the
    numbers the statistic needs (None: this record has none). statistic: {column: [B, n]} (+ strata [n]) -> [B].
    stratified: resample within task (LongBench)."""

    name: str
    unit: str
    description: str
    family: str  # the task family whose samples it uses (key of a report's "skipped")
    tasks: Callable[[str], bool]
    columns: Callable[[dict], dict[str, float] | None]
    statistic: Callable[[dict[str, np.ndarray], np.ndarray], np.ndarray]
    source_value: Callable[[dict[str, np.ndarray], np.ndarray], float]
    candidate_value: Callable[[dict[str, np.ndarray], np.ndarray], float]
    stratified: bool = False
    floor: float | None = None  # tasks the source scores below this (display units) are left out: uninformative


def _ppl(nll: np.ndarray, n: np.ndarray) -> np.ndarray:
    return np.exp(nll.sum(-1) / n.sum(-1))


def _ppl_increase(c, _):
    # ppl_c / ppl_s = exp((sum nll_c - sum nll_s) / tokens): exact ratio without overflow.
    return 100.0 * np.expm1((c["candidate_nll"].sum(-1) - c["source_nll"].sum(-1)) / c["n"].sum(-1))


def _kl(c, _):
    return c["kl"].sum(-1) / c["n"].sum(-1)


def _acc_drop(c, _):
    return 100.0 * (c["source"].mean(-1) - c["candidate"].mean(-1))


def _answer_increase(c, _):
    return (c["candidate"] - c["source"]).mean(-1)


def _answer_nll(record: dict) -> dict[str, float] | None:
    if "answer_nll" not in record["source"]:  # a sample without a reference answer
        return None
    return {"source": float(record["source"]["answer_nll"]), "candidate": float(record["candidate"]["answer_nll"])}


def _answer_task(task: str) -> bool:
    """The tasks whose samples carry a reference answer (RULER's answers are lists of values: none)."""
    return task in ("passkey", "niah") or task.startswith("longbench/")


def _task_average(values: np.ndarray, strata: np.ndarray) -> np.ndarray:
    """Mean over strata of the per-stratum mean along the last axis."""
    means = [values[..., strata == s].mean(-1) for s in np.unique(strata)]
    return np.mean(means, axis=0)


def _longbench_drop(c, strata):
    return 100.0 * (_task_average(c["source"], strata) - _task_average(c["candidate"], strata))


def _scores(record: dict) -> dict[str, float]:
    return {"source": float(record["source"]["score"]), "candidate": float(record["candidate"]["score"])}


def _ppl_columns(record: dict) -> dict[str, float]:
    return {"source_nll": record["source_nll"], "candidate_nll": record["candidate_nll"],
            "kl": record["kl"], "n": float(record["n_tokens"])}


def _mean100(key):
    return lambda c, _: float(100.0 * c[key].mean())


def _lb_mean(key):
    return lambda c, strata: float(100.0 * _task_average(c[key], strata))


GATE_METRICS: dict[str, GateMetric] = {m.name: m for m in (
    GateMetric("perplexity_increase_pct", "%", "perplexity increase on the essays", "perplexity",
               lambda t: t == "perplexity", _ppl_columns, _ppl_increase,
               lambda c, _: float(_ppl(c["source_nll"], c["n"])), lambda c, _: float(_ppl(c["candidate_nll"], c["n"]))),
    GateMetric("kl_mean", "nats/token", "mean token KL(source || candidate) on the essays", "perplexity",
               lambda t: t == "perplexity", _ppl_columns, _kl, lambda c, _: 0.0, lambda c, _: float(_kl(c, None))),
    GateMetric("passkey_accuracy_drop", "pp", "passkey accuracy drop (percentage points)", "passkey",
               lambda t: t == "passkey", _scores, _acc_drop, _mean100("source"), _mean100("candidate")),
    GateMetric("niah_accuracy_drop", "pp", "NIAH score drop (percentage points)", "niah",
               lambda t: t == "niah", _scores, _acc_drop, _mean100("source"), _mean100("candidate")),
    GateMetric("ruler_accuracy_drop", "pp", "RULER score drop, all tasks pooled (percentage points)", "ruler",
               lambda t: t.startswith("ruler/"), _scores, _acc_drop, _mean100("source"), _mean100("candidate")),
    GateMetric("longbench_avg_drop", "points", "LongBench average drop (mean over tasks, 0-100 scale)", "longbench",
               lambda t: t.startswith("longbench/"), _scores, _longbench_drop, _lb_mean("source"),
               _lb_mean("candidate"), stratified=True, floor=LONGBENCH_FLOOR),
    # Paired per sample, resampled over all samples pooled (not per task): it needs no minimum per task, so the
    # smoke suite's one LongBench sample per task still gives an interval.
    GateMetric("answer_nll_increase", "nats/token", "reference answers' NLL increase (mean over task samples, "
               "nats per answer token, teacher-forced)", "answers", _answer_task, _answer_nll, _answer_increase,
               lambda c, _: float(c["source"].mean()), lambda c, _: float(c["candidate"].mean())),
)}


@dataclass
class Estimate:
    """A gated quantity on one report: point estimate, CI bounds (None: too few samples for an
    interval, see no_interval), source/candidate values."""

    metric: str
    point: float
    low: float | None
    high: float | None
    source: float
    candidate: float
    n: int
    confidence: float
    no_interval: str | None = None  # why there is no interval (None when there is one)
    detectable: float | None = None  # smallest degradation whose interval would clear 0 (detectable_degradation)
    left_out: dict | None = None  # task -> why it is not counted (uninformative_tasks)

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def uninformative_tasks(samples: dict[str, list[dict]], metric: GateMetric) -> dict[str, str]:
    """task -> why it is left out of the metric: the source scores below the metric's floor there."""
    if metric.floor is None:
        return {}
    left_out = {}
    for task in sorted(t for t in samples if metric.tasks(t)):
        mean = 100.0 * float(np.mean([r["source"]["score"] for r in samples[task]]))
        if mean < metric.floor:
            left_out[task] = (f"the source scores {mean:.1f} points (< {metric.floor:g}): at the floor on this model, "
                              "a drop cannot show; not informative, left out")
    return left_out


def collect(samples: dict[str, list[dict]], metric: GateMetric) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    """Columns [n] and strata labels [n] (task index) for a metric, without the tasks it leaves out
    (uninformative_tasks); None when no samples remain."""
    rows, strata = [], []
    left_out = uninformative_tasks(samples, metric)
    for index, task in enumerate(sorted(t for t in samples if metric.tasks(t) and t not in left_out)):
        for record in samples[task]:
            columns = metric.columns(record)
            if columns is not None:  # None: the record lacks what this metric needs
                rows.append(columns)
                strata.append(index)
    if not rows:
        return None
    columns = {k: np.array([r[k] for r in rows], dtype=np.float64) for k in rows[0]}
    return columns, np.array(strata)


def resample_indices(strata: np.ndarray, n_boot: int, rng: np.random.Generator, stratified: bool) -> np.ndarray:
    """[n_boot, n] indices: plain resampling, or within each stratum (positions keep their stratum)."""
    n = len(strata)
    if not stratified:
        return rng.integers(0, n, size=(n_boot, n))
    idx = np.empty((n_boot, n), dtype=np.int64)
    for s in np.unique(strata):
        members = np.flatnonzero(strata == s)
        idx[:, members] = members[rng.integers(0, len(members), size=(n_boot, len(members)))]
    return idx


def estimate(samples: dict[str, list[dict]], name: str, n_boot: int = 2000, confidence: float = 0.95,
             seed: int = 0) -> Estimate | None:
    """Point estimate and paired-bootstrap percentile CI of a gated quantity (None if not measured)."""
    if name not in GATE_METRICS:
        raise KVConvertError(f"unknown gate metric {name!r}; known: {', '.join(GATE_METRICS)}")
    if not 0.0 < confidence < 1.0:
        raise KVConvertError(f"confidence must be in (0, 1), got {confidence}")
    metric = GATE_METRICS[name]
    found = collect(samples, metric)
    if found is None:
        return None
    columns, strata = found
    point = float(metric.statistic(columns, strata))
    values = (metric.source_value(columns, strata), metric.candidate_value(columns, strata), len(strata), confidence)
    left_out = uninformative_tasks(samples, metric) or None
    too_few = too_few_samples(strata, metric.stratified)
    if too_few is not None:
        return Estimate(name, point, None, None, *values, no_interval=too_few, left_out=left_out,
                        detectable=detectable_degradation(metric, len(strata), None, confidence))
    idx = resample_indices(strata, n_boot, np.random.default_rng(seed), metric.stratified)
    boot = metric.statistic({k: v[idx] for k, v in columns.items()}, strata)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(boot, [alpha, 1.0 - alpha])
    return Estimate(name, point, float(low), float(high), *values, left_out=left_out,
                    detectable=detectable_degradation(metric, len(strata), boot, confidence))


def detectable_degradation(metric: GateMetric, n: int, boot: np.ndarray | None, confidence: float) -> float | None:
    """The smallest degradation whose paired-bootstrap interval would clear 0 on a suite of this size.

    Accuracy metrics (0/1 per sample, unit pp): exact for a source that is right on every sample: with k of n
    samples flipped, a resample draws Binomial(n, k/n) of them and the interval's low end is 0 while drawing
    none has probability (1 - k/n)^n >= (1 - confidence) / 2; the smallest k past that, as 100 k / n points.
    Passkey's 6 samples: 3 flips (50 points). Continuous metrics: z x the bootstrap's standard error on this
    report (its spread comes from the candidate's damage, so a candidate identical to the source gives None)."""
    tail = (1.0 - confidence) / 2.0
    if metric.unit == "pp":
        flips = math.floor(n * (1.0 - tail ** (1.0 / n))) + 1
        return 100.0 * min(flips, n) / n
    if boot is None or float(np.std(boot)) == 0.0:
        return None
    return float(NormalDist().inv_cdf(1.0 - tail) * np.std(boot))


def too_few_samples(strata: np.ndarray, stratified: bool) -> str | None:
    """Why the bootstrap cannot give an interval for these samples (None: it can)."""
    counts = np.unique(strata, return_counts=True)[1] if stratified else np.array([len(strata)])
    if counts.min() >= MIN_SAMPLES_FOR_INTERVAL:
        return None
    if stratified:
        return (f"{int((counts < MIN_SAMPLES_FOR_INTERVAL).sum())} of {len(counts)} tasks have 1 sample "
                f"(an interval needs >= {MIN_SAMPLES_FOR_INTERVAL} per task)")
    return f"{len(strata)} sample (an interval needs >= {MIN_SAMPLES_FOR_INTERVAL})"
