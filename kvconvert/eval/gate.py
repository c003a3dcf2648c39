"""`kvconvert gate`: pass/fail a validation report against a policy file.

Policy (YAML, validated with pydantic, unknown keys or metrics are errors):

    description: free text
    decide_on: ci_low          # ci_low (default) | point | ci_high
    bootstrap: {samples: 2000, confidence: 0.95, seed: 0}
    require: [longbench_avg_drop]      # metrics that must be in the report (else: fail); each needs a threshold
    thresholds:                        # maximum allowed degradation per gated metric
      perplexity_increase_pct: 5.0     # %
      kl_mean: 0.05                    # nats/token
      passkey_accuracy_drop: 10        # percentage points
      niah_accuracy_drop: 10
      ruler_accuracy_drop: 10
      longbench_avg_drop: 3.0          # LongBench points (0-100)

decide_on says which number is compared with the threshold. ci_low: the lower bound of the
paired-bootstrap interval of the degradation, so a metric fails only when the candidate is
worse than allowed with the stated confidence (noise on a handful of samples cannot fail it).
point: the plain estimate. ci_high: the upper bound (pass only when the candidate is shown to be
within the threshold). A metric the report does not measure (e.g. RULER in the quick suite) is
shown as "n/a" and passes unless it is listed under `require`; one the report's suite is defined
to run but skipped (LongBench data missing, windows longer than the context) fails: a skipped
measurement is no evidence. A metric measured on too few
samples for an interval (one LongBench sample per task) is "undecided" under ci_low / ci_high:
the gate claims no confidence it does not have; it passes unless listed under `require` (then it
fails), and `decide_on: point` (a declared non-statistical rule) decides it on the estimate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from kvconvert.errors import KVConvertError
from kvconvert.eval.stats import GATE_METRICS, estimate
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
    decide_on: Literal["ci_low", "point", "ci_high"] = "ci_low"
    bootstrap: Bootstrap = Bootstrap()
    require: list[str] = []
    thresholds: Thresholds


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
    return report


# The SuiteSpec field (report["suite"]["spec"]) that says whether a suite measures each task family.
SUITE_FAMILY_FIELDS = {"perplexity": "ppl_windows", "passkey": "passkey_lengths", "niah": "niah_lengths",
                       "ruler": "ruler_tasks", "longbench": "longbench"}


def suite_runs(suite: dict, family: str) -> bool:
    """Whether the report's suite is defined to measure `family` (False when the report does not say)."""
    return bool(suite.get("spec", {}).get(SUITE_FAMILY_FIELDS.get(family, ""), False))


def evaluate(report: dict, policy: Policy) -> list[dict]:
    """One row per gated metric: source, candidate, estimate, CI, threshold, decided value, status."""
    rows = []
    settings = policy.bootstrap
    for name, threshold in policy.thresholds.model_dump().items():
        if threshold is None:
            continue
        found = estimate(report["samples"], name, settings.samples, settings.confidence, settings.seed)
        if found is None:
            family = GATE_METRICS[name].family
            why = report.get("skipped", {}).get(family, "not measured by this suite")
            skipped = family in report.get("skipped", {}) and suite_runs(report["suite"], family)
            if skipped:
                why = f"the {report['suite'].get('name')} suite runs {family}, this report skipped it: {why}"
            status = "fail" if name in policy.require or skipped else "n/a"
            rows.append({"metric": name, "unit": GATE_METRICS[name].unit, "threshold": threshold, "status": status,
                         "reason": why})
            continue
        row = {**found.as_dict(), "unit": GATE_METRICS[name].unit, "threshold": threshold}
        decided = {"ci_low": found.low, "point": found.point, "ci_high": found.high}[policy.decide_on]
        if decided is None:
            rows.append({**row, "status": "fail" if name in policy.require else "undecided",
                         "reason": f"not enough samples to decide: {found.no_interval}; "
                                   "run a larger suite, or gate on the estimate with decide_on: point"})
            continue
        rows.append({**row, "decided": decided, "status": "pass" if decided <= threshold else "fail"})
    return rows


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
        style = {"pass": "green", "undecided": "yellow"}.get(row["status"], "red")
        result = f"[{style}]{row['status'].upper()}[/]"  # an undecided row's reason follows the table
        table.add_row(f"{row['metric']} ({row['unit']})", f"{row['source']:.{digits}f}", f"{row['candidate']:.{digits}f}",
                      f"{row['point']:+.{digits}f}", ci, f"{row['threshold']:g}", result)
    rule = {"ci_low": f"the {conf}% CI's lower bound", "point": "the estimate",
            "ci_high": f"the {conf}% CI's upper bound"}[policy.decide_on]
    table.caption = f"degradation = candidate worse than source (positive = worse); FAIL when {rule} > threshold"
    console = Console(width=max(Console().width, 132))
    console.print(table)
    for row in rows:
        if "point" in row and "reason" in row:
            console.print(f"{row['metric']}: {row['status'].upper()}, {escape(row['reason'])}", soft_wrap=True)


def run_gate(report_path: Path, policy_path: Path) -> bool:
    """Print the gate table of the report under the policy and the verdict; True when it passes."""
    policy = load_policy(policy_path)
    report = load_report(report_path)
    rows = evaluate(report, policy)
    print_gate_table(rows, policy, report, Path(policy_path))
    failed = [r["metric"] for r in rows if r["status"] == "fail"]
    print(f"gate FAILED: {', '.join(failed)}" if failed else "gate passed")
    return not failed
