"""`kvconvert gate`: pass/fail a validation report against a policy file.

Policy (YAML, validated with pydantic, unknown keys or metrics are errors):

    description: free text
    decide_on: interval        # interval (default) | point
    on_inconclusive: fail      # fail (default) | pass: whether an INCONCLUSIVE metric blocks
    bootstrap: {samples: 2000, confidence: 0.95, seed: 0}
    require: [longbench_avg_drop]      # metrics that must be in the report (else: fail); each needs a threshold
    thresholds:                        # maximum allowed degradation per gated metric
      perplexity_increase_pct: 5.0     # %
      kl_mean: 0.05                    # nats/token
      answer_nll_increase: 0.05        # nats per answer token
      passkey_accuracy_drop: 10        # percentage points
      ...

Three verdicts per metric (decide_on: interval), on the paired-bootstrap interval of its degradation:
PASS when the whole interval is within the threshold (high <= threshold), FAIL when the whole interval is
past it (low > threshold), INCONCLUSIVE when it straddles the threshold: the suite is too small to tell, and
the row says roughly how many samples would decide (an interval's width shrinks as 1/sqrt(n)). A metric
measured on too few samples for an interval (one LongBench sample per task) is INCONCLUSIVE too.
on_inconclusive says whether INCONCLUSIVE blocks the gate; a metric listed under `require` with too few
samples for an interval blocks either way (required means measured). decide_on: point gates on the plain estimate (a declared non-statistical rule: PASS or FAIL).

A metric the report does not measure (e.g. RULER in the quick suite) is shown as "n/a" and passes unless it
is listed under `require`; one the report's suite is defined to run but skipped (LongBench data missing,
windows longer than the context) fails: a skipped measurement is no evidence.
"""

from __future__ import annotations

import json
from pathlib import Path
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from kvconvert.errors import KVConvertError
from kvconvert.eval.stats import GATE_METRICS, estimate, uninformative_tasks
from kvconvert.eval.suites import SUITE_VERSION
from kvconvert.stage_options import read_yaml, validation_problems


# Maximum allowed degradation per gated metric (leave one out to not gate it): one optional key per
# metric that kvconvert.eval.stats defines, so a new metric is gateable without a second list.
Thresholds = create_model("Thresholds", __config__=ConfigDict(extra="forbid"),
                          **{name: (float | None, Field(None, ge=0, description=m.description))
                             for name, m in GATE_METRICS.items()})


class Bootstrap(BaseModel):
    model_config = ConfigDict(extra="forbid")
    samples: int = Field(2000, ge=100, le=100000)
    confidence: float = Field(0.95, gt=0.5, lt=1.0)
    seed: int = 0


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    description: str = ""
    decide_on: Literal["interval", "point"] = "interval"
    on_inconclusive: Literal["fail", "pass"] = "fail"
    bootstrap: Bootstrap = Bootstrap()
    require: list[str] = []
    thresholds: Thresholds

    @field_validator("decide_on", mode="before")
    @classmethod
    def _replaced_bounds(cls, value):
        if value in RETIRED_DECIDE_ON:  # the one-sided rules the three verdicts replaced
            raise ValueError(f"decide_on: {value} was replaced by the three verdicts; write decide_on: interval "
                             f"with {RETIRED_DECIDE_ON[value]}")
        return value


# decide_on values of older policies -> the setting that gives the same pass/fail.
RETIRED_DECIDE_ON = {"ci_low": "on_inconclusive: pass (fail only when shown worse than the threshold)",
                     "ci_high": "on_inconclusive: fail (pass only when shown within the threshold)"}


def load_policy(path: Path) -> Policy:
    """Parse and validate a policy file, or the built-in policy of that name (default, smoke, strict:
    kvconvert.resources.find_policy); errors name the file and the offending key."""
    from kvconvert.resources import find_policy

    path = find_policy(path)
    data = read_yaml(path, "policy file not found")
    if not isinstance(data, dict):
        raise KVConvertError(f"{path}: a policy must be a mapping with a 'thresholds' section")
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        raise KVConvertError(f"{path}: {validation_problems(exc, Policy)}") from None
    unknown = [m for m in policy.require if m not in GATE_METRICS]
    if unknown:
        raise KVConvertError(f"{path}: unknown metric(s) {', '.join(unknown)} in require; known: {', '.join(GATE_METRICS)}")
    unbounded = [m for m in policy.require if getattr(policy.thresholds, m) is None]
    if unbounded:  # evaluate() gates the thresholds: a required metric without one was never checked
        raise KVConvertError(f"{path}: require lists {', '.join(unbounded)} with no threshold, so the gate would never "
                             f"check it; add thresholds: {{{', '.join(f'{m}: N' for m in unbounded)}}} (the largest "
                             "degradation allowed) or drop it from require")
    if all(v is None for v in policy.thresholds.model_dump().values()):
        raise KVConvertError(f"{path}: no thresholds set; a gate that checks nothing always passes")
    return policy


# --------------------------------------------------------------------------- reports

def load_report(path: Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    if not path.is_file():
        raise KVConvertError(f"{path}: report not found; run `kvconvert validate ... --out DIR` first")
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KVConvertError(f"{path}: not a valid report ({getattr(exc, 'msg', exc)}; truncated or corrupt?); "
                             "re-run kvconvert validate with the same --out to rewrite it") from None
    suite = report.get("suite") if isinstance(report, dict) else None
    if not isinstance(suite, dict) or "version" not in suite or "samples" not in report:
        raise KVConvertError(f"{path}: not a kvconvert validate report (no suite or samples); "
                             "pass the report.json that kvconvert validate --out DIR wrote, or re-run validate")
    if suite["version"] != SUITE_VERSION:
        raise KVConvertError(
            f"{path}: made with suite version {suite['version']} of the {suite.get('name')} suite, this kvconvert "
            f"uses version {SUITE_VERSION}; re-run kvconvert validate to get comparable numbers")
    _check_engine_results(path, report)
    return report


def _check_engine_results(path: Path, report: dict) -> None:
    """A report whose stock engine (validate --engine vllm / llamacpp) was asked for and gave no result (its phase
    killed: "pending"; failed: "error") is not gated on the runtime's numbers alone."""
    for engine, section in (report.get("engines") or {}).items():
        if isinstance(section, dict) and ("pending" in section or "error" in section):
            why = " ".join(str(section.get("pending") or section["error"]).split())
            raise KVConvertError(f"{path}: validate --engine {engine} has no result in this report ({why[:300]}); "
                                 f"rerun validate with the same --out to finish it, or without --engine {engine} if "
                                 "its numbers are not needed")


# The SuiteSpec fields (report["suite"]["spec"]) any of which says that a suite measures each task family.
SUITE_FAMILY_FIELDS = {"perplexity": ("ppl_windows",), "passkey": ("passkey_lengths", "long_lengths"),
                       "niah": ("niah_lengths", "long_lengths"), "ruler": ("ruler_tasks",), "longbench": ("longbench",)}


def suite_runs(suite: dict, family: str) -> bool:
    """Whether the report's suite is defined to measure `family` (False when the report does not say)."""
    spec = suite.get("spec", {})
    return any(spec.get(field, False) for field in SUITE_FAMILY_FIELDS.get(family, ()))


def evaluate(report: dict, policy: Policy) -> list[dict]:
    """One row per gated metric: source, candidate, estimate, CI, threshold, status (pass, fail,
    inconclusive, n/a), blocks (whether the row fails the gate) and, where needed, reason."""
    rows = []
    settings = policy.bootstrap
    for name, threshold in policy.thresholds.model_dump().items():
        if threshold is None:
            continue
        found = estimate(report["samples"], name, settings.samples, settings.confidence, settings.seed)
        row = _unmeasured_row(report, policy, name, threshold) if found is None else _verdict_row(found, policy, threshold)
        # a required metric must be measured: with too few samples for an interval it blocks whatever
        # on_inconclusive says; an interval straddling the threshold blocks as the policy says
        unmeasured = name in policy.require and row.get("point") is not None and row.get("low") is None
        row["blocks"] = row["status"] == "fail" or (row["status"] == "inconclusive"
                                                    and (unmeasured or policy.on_inconclusive == "fail"))
        rows.append(row)
    return rows


def _unmeasured_row(report: dict, policy: Policy, name: str, threshold: float) -> dict:
    family = GATE_METRICS[name].family
    why = report.get("skipped", {}).get(family, "not measured by this suite")
    left_out = uninformative_tasks(report["samples"], GATE_METRICS[name])
    if left_out:  # measured, and every task uninformative on this model: no evidence either way
        return {"metric": name, "unit": GATE_METRICS[name].unit, "threshold": threshold,
                "status": "fail" if name in policy.require else "n/a",
                "reason": "every task left out: " + "; ".join(f"{t}: {r}" for t, r in left_out.items())}
    skipped = family in report.get("skipped", {}) and suite_runs(report["suite"], family)
    if skipped:
        why = f"the {report['suite'].get('name')} suite runs {family}, this report skipped it: {why}"
    status = "fail" if name in policy.require or skipped else "n/a"
    return {"metric": name, "unit": GATE_METRICS[name].unit, "threshold": threshold, "status": status, "reason": why}


def _verdict_row(found, policy: Policy, threshold: float) -> dict:
    row = {**found.as_dict(), "unit": GATE_METRICS[found.metric].unit, "threshold": threshold}
    if policy.decide_on == "point":
        return {**row, "status": "pass" if found.point <= threshold else "fail"}
    if found.low is None:
        return {**row, "status": "inconclusive",
                "reason": f"not enough samples for an interval: {found.no_interval}; run a larger suite, "
                          "or gate on the estimate with decide_on: point"}
    if found.high <= threshold:
        return {**row, "status": "pass"}
    if found.low > threshold:
        return {**row, "status": "fail"}
    return {**row, "status": "inconclusive", "reason": inconclusive_reason(found, threshold)}


def samples_to_decide(point: float, low: float, high: float, n: int, threshold: float) -> float:
    """Roughly how many samples would put the interval wholly on one side of the threshold, if the estimate
    stayed where it is: the interval's width scales as 1/sqrt(n), so the half-width on the threshold's
    side must shrink by (distance to the threshold) / (half-width now): n x that ratio's inverse squared.
    inf when the estimate sits on the threshold (no sample count decides it)."""
    gap = threshold - point
    half = high - point if gap > 0 else point - low  # the side of the interval that crosses the threshold
    if gap == 0 or half <= 0:
        return math.inf
    return n * (half / abs(gap)) ** 2


def inconclusive_reason(found, threshold: float) -> str:
    needed = samples_to_decide(found.point, found.low, found.high, found.n, threshold)
    lean = "within" if found.point <= threshold else "past"
    about = ("no sample count decides it: the estimate sits on the threshold" if math.isinf(needed)
             else f"about {math.ceil(needed)} samples (now {found.n}) would decide it if the estimate held")
    return f"the interval straddles the threshold {threshold:g} (estimate {lean} it); {about}"


def gate_summary(rows: list[dict], policy: Policy) -> str:
    """The verdict line: which metrics block, or which kind of pass it is (every gated interval within its
    threshold, or a pass that the policy's on_inconclusive: pass lets through with undecided metrics)."""
    failed = [r["metric"] for r in rows if r["blocks"]]
    if failed:
        return f"gate FAILED: {', '.join(failed)}"
    open_rows = [r["metric"] for r in rows if r["status"] == "inconclusive"]
    if open_rows:
        return (f"gate passed with INCONCLUSIVE metrics ({', '.join(open_rows)}): not shown within their "
                "thresholds, allowed by the policy's on_inconclusive: pass")
    rule = "on the estimate (decide_on: point)" if policy.decide_on == "point" else "whole interval within"
    return f"gate passed: PASS on every gated metric ({rule})"


def print_gate_table(rows: list[dict], policy: Policy, report: dict, policy_path: Path) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    conf = round(100 * policy.bootstrap.confidence)
    table = Table(title=f"kvconvert gate: {policy_path.name} on the {report['suite']['name']} suite "
                        f"(decides on {policy.decide_on}, {conf}% paired bootstrap)")
    for column in ("metric", "source", "candidate", "degradation", f"{conf}% CI", "threshold", "result"):
        table.add_column(column, justify="left" if column in ("metric", "result") else "right")
    for row in rows:
        if "point" not in row:
            table.add_row(f"{row['metric']} ({row['unit']})", "-", "-", "-", "-", f"{row['threshold']:g}",
                          f"[yellow]{row['status'].upper()}[/] ({escape(row['reason'])})")
            continue
        digits = 5 if row["unit"] == "nats/token" else 3
        ci = "-" if row["low"] is None else escape(f"[{row['low']:+.{digits}f}, {row['high']:+.{digits}f}]")
        style = {"pass": "green", "inconclusive": "yellow"}.get(row["status"], "red")
        blocks = " (blocks)" if row["status"] == "inconclusive" and row["blocks"] else ""
        result = f"[{style}]{row['status'].upper()}[/]{blocks}"  # an inconclusive row's reason follows the table
        table.add_row(f"{row['metric']} ({row['unit']})", f"{row['source']:.{digits}f}", f"{row['candidate']:.{digits}f}",
                      f"{row['point']:+.{digits}f}", ci, f"{row['threshold']:g}", result)
    rule = ("on the estimate: FAIL when it is > threshold" if policy.decide_on == "point" else
            f"PASS: whole {conf}% CI <= threshold; FAIL: whole CI > threshold; INCONCLUSIVE: it straddles "
            f"(on_inconclusive: {policy.on_inconclusive})")
    table.caption = f"degradation = candidate worse than source (positive = worse); {rule}"
    console = Console(width=max(Console().width, 132))
    console.print(table)
    for row in rows:
        if "point" in row and "reason" in row:
            console.print(f"{row['metric']}: {row['status'].upper()}, {escape(row['reason'])}", soft_wrap=True)
        for task, why in (row.get("left_out") or {}).items():
            console.print(f"{row['metric']}: {task} left out of the verdict: {escape(why)}", soft_wrap=True)


def run_gate(report_path: Path, policy_path: Path) -> bool:
    """Print the gate table of the report under the policy and the verdict; True when it passes."""
    policy = load_policy(policy_path)
    report = load_report(report_path)
    rows = evaluate(report, policy)
    print_gate_table(rows, policy, report, Path(policy_path))
    print(gate_summary(rows, policy))
    return not any(r["blocks"] for r in rows)
