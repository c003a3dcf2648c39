"""Report assembly and output: report.json, report.md, PNG charts, the terminal summary.

Metric entries (report["metrics"][name]): source, candidate, delta (= candidate - source),
unit, higher_is_better, n (samples). Accuracies and LongBench scores are on a 0-100 scale.
report["estimates"][gate_metric]: the gated degradations with a 95% paired-bootstrap interval
(what `kvconvert gate` recomputes with the policy's settings).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from kvconvert.checkpoint import atomic_write_text
from kvconvert.eval.metrics import LONGBENCH_TASKS
from kvconvert.eval.stats import GATE_METRICS, estimate

REPORT_BOOTSTRAP = {"samples": 2000, "confidence": 0.95, "seed": 0}


def _entry(source: float, candidate: float, unit: str, higher_is_better: bool, n: int) -> dict:
    return {"source": source, "candidate": candidate, "delta": candidate - source, "unit": unit,
            "higher_is_better": higher_is_better, "n": n}


def _mean_scores(records: list[dict], role: str) -> float:
    return 100.0 * float(np.mean([r[role]["score"] for r in records]))


def build_metrics(samples: dict[str, list[dict]]) -> dict[str, dict]:
    """Display metrics from per-sample results (see the module docstring for the fields)."""
    metrics: dict[str, dict] = {}
    ppl = samples.get("perplexity") or []
    if ppl:
        n = sum(r["n_tokens"] for r in ppl)
        src = math.exp(sum(r["source_nll"] for r in ppl) / n)
        cand = math.exp(sum(r["candidate_nll"] for r in ppl) / n)
        metrics["perplexity"] = {**_entry(src, cand, "ppl", False, len(ppl)), "delta_pct": 100.0 * (cand / src - 1.0),
                                 "tokens": n}
        metrics["kl_mean"] = _entry(0.0, sum(r["kl"] for r in ppl) / n, "nats/token", False, len(ppl))
    for family in ("passkey", "niah"):
        if samples.get(family):
            records = samples[family]
            metrics[f"{family}_accuracy"] = _entry(_mean_scores(records, "source"), _mean_scores(records, "candidate"),
                                                   "%", True, len(records))
    ruler = {t: r for t, r in samples.items() if t.startswith("ruler/")}
    if ruler:
        pooled = [r for records in ruler.values() for r in records]
        metrics["ruler_accuracy"] = _entry(_mean_scores(pooled, "source"), _mean_scores(pooled, "candidate"),
                                           "%", True, len(pooled))
        for task, records in sorted(ruler.items()):
            metrics[task] = _entry(_mean_scores(records, "source"), _mean_scores(records, "candidate"), "%", True,
                                   len(records))
    metrics.update(_longbench_metrics(samples))
    return metrics


def _longbench_metrics(samples: dict[str, list[dict]]) -> dict[str, dict]:
    tasks = {t.split("/", 1)[1]: r for t, r in samples.items() if t.startswith("longbench/")}
    if not tasks:
        return {}
    out: dict[str, dict] = {}
    per_task = {task: (_mean_scores(r, "source"), _mean_scores(r, "candidate"), len(r)) for task, r in tasks.items()}
    out["longbench_avg"] = _entry(float(np.mean([v[0] for v in per_task.values()])),
                                  float(np.mean([v[1] for v in per_task.values()])), "points", True,
                                  sum(v[2] for v in per_task.values()))
    categories: dict[str, list[str]] = {}
    for task in LONGBENCH_TASKS:
        if task in per_task:
            categories.setdefault(LONGBENCH_TASKS[task][2], []).append(task)
    for category, members in categories.items():
        out[f"longbench_category/{category}"] = _entry(
            float(np.mean([per_task[t][0] for t in members])), float(np.mean([per_task[t][1] for t in members])),
            "points", True, sum(per_task[t][2] for t in members))
    for task in LONGBENCH_TASKS:
        if task in per_task:
            s, c, n = per_task[task]
            out[f"longbench/{task}"] = _entry(s, c, "points", True, n)
    return out


def build_report(header: dict, samples: dict[str, list[dict]]) -> dict:
    estimates = {}
    for name in GATE_METRICS:
        found = estimate(samples, name, REPORT_BOOTSTRAP["samples"], REPORT_BOOTSTRAP["confidence"],
                         REPORT_BOOTSTRAP["seed"])
        if found is not None:
            estimates[name] = found.as_dict()
    return {**header, "metrics": build_metrics(samples), "estimates": estimates, "bootstrap": REPORT_BOOTSTRAP,
            "samples": samples}


# --------------------------------------------------------------------------- files

def write_report(report: dict, out: Path) -> list[Path]:
    """report.json, report.md and the charts into `out`; returns the paths written."""
    out = Path(out)
    written = [out / "report.json"]
    atomic_write_text(written[0], json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    from kvconvert.eval.plots import write_plots

    charts = write_plots(report, out)
    written.append(out / "report.md")
    atomic_write_text(written[-1], render_markdown(report, [p.name for p in charts]))
    return written + charts


def _fmt(value: float, unit: str) -> str:
    if unit in ("nats/token",):
        return f"{value:.5f}"
    if unit == "ppl":
        return f"{value:.3f}"
    return f"{value:.2f}"


def summary_rows(report: dict) -> list[tuple[str, str, str, str]]:
    """(metric, source, candidate, delta) strings for the main metrics (per-task rows excluded)."""
    rows = []
    for name, m in report["metrics"].items():
        if "/" in name:
            continue
        delta = f"{m['delta']:+.5f}" if m["unit"] == "nats/token" else f"{m['delta']:+.3f}"
        if "delta_pct" in m:
            delta += f" ({m['delta_pct']:+.2f}%)"
        rows.append((f"{name} ({m['unit']})", _fmt(m["source"], m["unit"]), _fmt(m["candidate"], m["unit"]), delta))
    return rows


def _model_line(model: dict) -> str:
    return (f"`{model['path']}` ({model['architecture']}, engine {model['engine']}, KV {model['kv_dtype']}, "
            f"fingerprint {model['fingerprint']})")


def render_markdown(report: dict, charts: list[str]) -> str:
    suite = report["suite"]
    lines = [
        f"# kvconvert validate: {suite['name']} suite (v{suite['version']})", "",
        f"- source: {_model_line(report['source'])}",
        f"- candidate: {_model_line(report['candidate'])}",
        (f"- context {report['settings']['context']} tokens, {report['seconds']} s, cache hits "
         f"{report['cache']['hits']} / misses {report['cache']['misses']}, created {report['created']}"), "",
        "## Metrics", "", "| metric | source | candidate | delta | n |", "|---|---:|---:|---:|---:|",
    ]
    for name, m in report["metrics"].items():
        delta = f"{m['delta']:+.5f}" if m["unit"] == "nats/token" else f"{m['delta']:+.3f}"
        if "delta_pct" in m:
            delta += f" ({m['delta_pct']:+.2f}%)"
        lines.append(f"| {name} [{m['unit']}] | {_fmt(m['source'], m['unit'])} | {_fmt(m['candidate'], m['unit'])} "
                     f"| {delta} | {m['n']} |")
    if report["estimates"]:
        conf = int(100 * report["bootstrap"]["confidence"])
        lines += ["", f"## Degradations gated by `kvconvert gate` ({conf}% paired bootstrap CI)", "",
                  "| quantity | estimate | CI low | CI high | n |", "|---|---:|---:|---:|---:|"]
        for name, e in report["estimates"].items():
            unit = GATE_METRICS[name].unit
            ci = ("too few samples", "") if e.get("low") is None else (f"{e['low']:.4f}", f"{e['high']:.4f}")
            lines.append(f"| {name} [{unit}] | {e['point']:.4f} | {ci[0]} | {ci[1]} | {e['n']} |")
    if report["skipped"] or report["notes"]:
        lines += ["", "## Notes", ""]
        lines += [f"- skipped {k}: {v}" for k, v in report["skipped"].items()]
        lines += [f"- {n}" for n in report["notes"]]
    if charts:
        lines += ["", "## Charts", ""] + [f"![{c}]({c})" for c in charts]
    lines += ["", "Per-sample results (prompts' token counts, outputs, scores) are in report.json.", ""]
    return "\n".join(lines)


def print_summary(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    suite = report["suite"]
    table = Table(title=f"kvconvert validate: {suite['name']} suite v{suite['version']} ({report['seconds']} s)")
    for column, justify in (("metric", "left"), ("source", "right"), ("candidate", "right"), ("delta", "right")):
        table.add_column(column, justify=justify)
    for row in summary_rows(report):
        table.add_row(*row)
    Console(width=max(Console().width, 100)).print(table)
