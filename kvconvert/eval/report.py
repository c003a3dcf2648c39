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
from kvconvert.eval.gate import Bootstrap
from kvconvert.eval.metrics import LONGBENCH_TASKS
from kvconvert.eval.stats import GATE_METRICS, estimate

REPORT_BOOTSTRAP = Bootstrap().model_dump()  # the gate policies' default: {"samples", "confidence", "seed"}


def _entry(source: float, candidate: float, unit: str, higher_is_better: bool, n: int) -> dict:
    return {"source": source, "candidate": candidate, "delta": candidate - source, "unit": unit,
            "higher_is_better": higher_is_better, "n": n}


def _score_entry(records: list[dict], unit: str) -> dict:
    """Mean score x 100 of source and candidate over generation records."""
    means = [100.0 * float(np.mean([r[role]["score"] for r in records])) for role in ("source", "candidate")]
    return _entry(*means, unit, True, len(records))


def _mean_entry(entries: list[dict]) -> dict:
    """Unweighted mean over (task) entries of their source and candidate values; n summed."""
    return _entry(float(np.mean([e["source"] for e in entries])), float(np.mean([e["candidate"] for e in entries])),
                  "points", True, sum(e["n"] for e in entries))


def perplexity_summary(records: list[dict]) -> dict:
    """Perplexity window records pooled: source and candidate ppl = exp(sum NLL / tokens), delta_pct,
    kl_mean (nats/token) and tokens."""
    n = sum(r["n_tokens"] for r in records)
    src = math.exp(sum(r["source_nll"] for r in records) / n)
    cand = math.exp(sum(r["candidate_nll"] for r in records) / n)
    return {"source": src, "candidate": cand, "delta_pct": 100.0 * (cand / src - 1.0),
            "kl_mean": sum(r["kl"] for r in records) / n, "tokens": n}


def build_metrics(samples: dict[str, list[dict]]) -> dict[str, dict]:
    """Display metrics from per-sample results (see the module docstring for the fields)."""
    metrics: dict[str, dict] = {}
    ppl = samples.get("perplexity") or []
    if ppl:
        pooled = perplexity_summary(ppl)
        metrics["perplexity"] = {**_entry(pooled["source"], pooled["candidate"], "ppl", False, len(ppl)),
                                 "delta_pct": pooled["delta_pct"], "tokens": pooled["tokens"]}
        metrics["kl_mean"] = _entry(0.0, pooled["kl_mean"], "nats/token", False, len(ppl))
        long = [r for r in ppl if r.get("context")]
        if long:  # the long window alone: KL where the cache already holds `context` tokens (shown, not gated)
            metrics[f"kl_mean_after_{long[0]['context']}"] = _entry(0.0, perplexity_summary(long)["kl_mean"],
                                                                    "nats/token", False, len(long))
    for family in ("passkey", "niah"):
        if samples.get(family):
            metrics[f"{family}_accuracy"] = _score_entry(samples[family], "%")
    ruler = {t: r for t, r in samples.items() if t.startswith("ruler/")}
    if ruler:
        metrics["ruler_accuracy"] = _score_entry([r for records in ruler.values() for r in records], "%")
        metrics.update({task: _score_entry(records, "%") for task, records in sorted(ruler.items())})
    metrics.update(_longbench_metrics(samples))
    answers = [r for t, records in samples.items() if GATE_METRICS["answer_nll_increase"].tasks(t)
               for r in records if "answer_nll" in r["source"]]
    if answers:  # mean over samples of the reference answer's NLL per token (lower is better)
        metrics["answer_nll"] = _entry(*(float(np.mean([r[role]["answer_nll"] for r in answers]))
                                         for role in ("source", "candidate")), "nats/token", False, len(answers))
    return metrics


def _longbench_metrics(samples: dict[str, list[dict]]) -> dict[str, dict]:
    """longbench_avg (mean over tasks), longbench_category/<category> and longbench/<task> entries."""
    per_task = {t.split("/", 1)[1]: _score_entry(r, "points") for t, r in samples.items() if t.startswith("longbench/")}
    if not per_task:
        return {}
    groups = {"longbench_avg": list(per_task)}
    for task in LONGBENCH_TASKS:
        if task in per_task:
            groups.setdefault(f"longbench_category/{LONGBENCH_TASKS[task][2]}", []).append(task)
    out = {name: _mean_entry([per_task[t] for t in members]) for name, members in groups.items()}
    out.update({f"longbench/{task}": per_task[task] for task in LONGBENCH_TASKS if task in per_task})
    return out


def build_report(header: dict, samples: dict[str, list[dict]]) -> dict:
    found = {name: estimate(samples, name, REPORT_BOOTSTRAP["samples"], REPORT_BOOTSTRAP["confidence"],
                            REPORT_BOOTSTRAP["seed"]) for name in GATE_METRICS}
    estimates = {name: e.as_dict() for name, e in found.items() if e is not None}
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
    if unit == "nats/token":
        return f"{value:.5f}"
    if unit == "ppl":
        return f"{value:.3f}"
    return f"{value:.2f}"


def _fmt_delta(metric: dict) -> str:
    delta = f"{metric['delta']:+.5f}" if metric["unit"] == "nats/token" else f"{metric['delta']:+.3f}"
    return delta + (f" ({metric['delta_pct']:+.2f}%)" if "delta_pct" in metric else "")


def summary_rows(report: dict) -> list[tuple[str, str, str, str]]:
    """(metric, source, candidate, delta) strings for the main metrics (per-task rows excluded)."""
    rows = []
    for name, m in report["metrics"].items():
        if "/" not in name:
            rows.append((f"{name} ({m['unit']})", _fmt(m["source"], m["unit"]), _fmt(m["candidate"], m["unit"]),
                         _fmt_delta(m)))
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
        lines.append(f"| {name} [{m['unit']}] | {_fmt(m['source'], m['unit'])} | {_fmt(m['candidate'], m['unit'])} "
                     f"| {_fmt_delta(m)} | {m['n']} |")
    if report["estimates"]:
        conf = int(100 * report["bootstrap"]["confidence"])
        lines += ["", f"## Degradations gated by `kvconvert gate` ({conf}% paired bootstrap CI)", "",
                  "| quantity | estimate | CI low | CI high | n | smallest detectable |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, e in report["estimates"].items():
            unit = GATE_METRICS[name].unit
            ci = ("too few samples", "") if e.get("low") is None else (f"{e['low']:.4f}", f"{e['high']:.4f}")
            found = "unknown" if e.get("detectable") is None else f"{e['detectable']:.4f}"
            lines.append(f"| {name} [{unit}] | {e['point']:.4f} | {ci[0]} | {ci[1]} | {e['n']} | {found} |")
        lines += ["", "smallest detectable: the degradation whose interval would clear 0 at this suite's size "
                      "(accuracies: exact, for a source right on every sample; continuous metrics: z x the "
                      "bootstrap's standard error here)."]
        lines += [f"- {name}: {task} left out of the verdict: {why}" for name, e in report["estimates"].items()
                  for task, why in (e.get("left_out") or {}).items()]
    if report["skipped"] or report["notes"]:
        lines += ["", "## Notes", ""]
        lines += [f"- skipped {k}: {v}" for k, v in report["skipped"].items()]
        lines += [f"- {n}" for n in report["notes"]]
    if charts:
        lines += ["", "## Charts", ""] + [f"![{c}]({c})" for c in charts]
    lines += ["", "Per-sample results (prompts' token counts, outputs, scores) are in report.json.", ""]
    # --engine vllm's / llamacpp's section, if any
    return "\n".join(lines) + "\n".join(markdown_section(report)) + "\n".join(llamacpp_section(report))


def print_summary(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    suite = report["suite"]
    table = Table(title=f"kvconvert validate: {suite['name']} suite v{suite['version']} ({report['seconds']} s)")
    for column, justify in (("metric", "left"), ("source", "right"), ("candidate", "right"), ("delta", "right")):
        table.add_column(column, justify=justify)
    for row in summary_rows(report):
        table.add_row(*row)
    console = Console(width=max(Console().width, 100))
    console.print(table)
    console.print("\n".join(detectable_lines(report)), highlight=False)


def detectable_lines(report: dict) -> list[str]:
    """Per gated metric, the smallest degradation this suite's size can detect (stats.detectable_degradation)."""
    conf = int(100 * report["bootstrap"]["confidence"])
    lines = [f"smallest degradation this suite can detect (its {conf}% interval clears 0):"]
    for name, e in report["estimates"].items():
        unit = GATE_METRICS[name].unit
        if e.get("detectable") is None:
            how = "unknown: no spread between the models on these samples (a damaged candidate shows it)"
        else:
            how = f"{_fmt(e['detectable'], unit)} {unit}"
            if unit == "pp":
                how += f" ({round(e['detectable'] * e['n'] / 100)} of {e['n']} samples flipping)"
            else:
                how += f" (z x the bootstrap's standard error on {e['n']} samples)"
        lines.append(f"  {name}: {how}")
    return lines


def markdown_section(report: dict) -> list[str]:
    """Lines for report.md: vLLM's numbers (`validate --engine vllm`, eval.engine_vllm) next to the bundled engine's."""
    section = report.get("engines", {}).get("vllm")
    if not section:
        return []
    lines = ["", "## Stock vLLM (same perplexity windows)", ""]
    if "error" in section or "pending" in section:
        return lines + [f"Not computed: {section.get('error') or section['pending']}", ""]
    bundled = section.get("bundled", {})
    engine = bundled.get("engine", "bundled")
    kv = section["settings"]["kv_cache_dtype"]
    lines += [f"vLLM {section.get('vllm_version', '?')}, float32 weights, KV cache source {kv['source']} / "
              f"candidate {kv['candidate']}, attention backend "
              f"{', '.join(sorted(set(section.get('attention', {}).get('candidate', {}).values()))) or '?'}; "
              f"{section['settings']['windows']} x {section['settings']['window_len']} tokens. KL from vLLM's full "
              "logits (captured at its logits processor; their log-softmax matches vLLM's prompt logprobs within "
              f"{section['logprob_check_max']:.1e}).", ""]
    emulated = section.get("emulated")
    columns = [("vLLM", section)]
    if emulated:
        columns.append((f"emulated: transformers, FP8 {emulated['rounding'].replace('_', ' ')}", emulated))
    columns.append((engine, bundled))
    lines += ["| metric | " + " | ".join(name for name, _ in columns) + " |", "|---|" + "---:|" * len(columns)]
    rows = [("source perplexity", "source", 3), ("candidate perplexity", "candidate", 3),
            ("candidate delta %", "delta_pct", 2), ("KL mean (nats/token)", None, 5)]
    for name, field, digits in rows:
        values = [column.get("perplexity", {}).get(field) if field else column.get("kl_mean") for _, column in columns]
        lines.append(f"| {name} | " + " | ".join("-" if v is None else f"{v:.{digits}f}" for v in values) + " |")
    if emulated and emulated["rounding"] != "nearest":
        lines += ["", f"vLLM on {section.get('platform')} stores FP8 K/V truncated toward zero; {engine} and GPU "
                      "engines round to nearest. The emulated column is the same checkpoint and scales with vLLM's "
                      f"rounding; {engine}'s column is what an RNE engine (vLLM on a GPU) delivers (docs/engines.md)."]
    scales = section.get("kv_scales_loaded", {}).get("candidate")
    if scales and scales["layers"] and kv["candidate"].startswith("fp8"):
        lines += ["", f"KV scales vLLM loaded for the candidate: {scales['layers']} layers, k {scales['k_min']:.4g}.."
                      f"{scales['k_max']:.4g}, v {scales['v_min']:.4g}..{scales['v_max']:.4g}"
                      + (" (all 1.0: none loaded)" if scales["all_one"] else "") + "."]
    lines += [f"- {note}" for note in section["notes"]]
    return lines + [""]


def _rotation_words(settings: dict) -> str:
    """llama.cpp's Hadamard rotation as it applied to each model's cache (engine_llamacpp.rotation_applied); a
    report from before that was recorded says only how the switch stood."""
    applied = settings.get("rotation_applied")
    if not applied:
        return f"rotation of quantized caches {'on' if settings['rotation'] else 'off'}"
    if applied["source"] == applied["candidate"]:
        return f"Hadamard rotation of the caches: {applied['candidate']}"
    return f"Hadamard rotation: source cache {applied['source']}, candidate cache {applied['candidate']}"


def llamacpp_section(report: dict) -> list[str]:
    """Lines for report.md: stock llama.cpp's numbers (`validate --engine llamacpp`, eval.engine_llamacpp) next to
    the bundled engine's on the same windows."""
    section = report.get("engines", {}).get("llamacpp")
    if not section:
        return []
    lines = ["", "## Stock llama.cpp (same perplexity windows)", ""]
    if "error" in section or "pending" in section:
        return lines + [f"Not computed: {section.get('error') or section['pending']}", ""]
    settings, bundled = section["settings"], section.get("bundled", {})
    kv = settings["kv_cache"]
    models = section.get("models", {})
    lines += [f"llama.cpp through llama-cpp-python {section.get('llama_cpp_python', '?')} (its C API), GGUF weights "
              f"{settings['weights']} (candidate: {models.get('candidate', '?')}), KV cache source {kv['source']} / candidate {kv['candidate']}, flash attention "
              f"{settings['flash_attn']['candidate']}, {_rotation_words(settings)}; {settings['windows']} x "
              f"{settings['window_len']} tokens. "
              "KL(source || candidate) and top-1 agreement summed inside llama.cpp's process.", ""]
    columns = [("llama.cpp", section), (f"{bundled.get('engine', 'bundled')} ({bundled.get('kv_dtype', '?')})", bundled)]
    lines += ["| metric | " + " | ".join(name for name, _ in columns) + " |", "|---|" + "---:|" * len(columns)]
    rows = [("source perplexity", "source", 3), ("candidate perplexity", "candidate", 3),
            ("candidate delta %", "delta_pct", 2), ("KL mean (nats/token)", "kl_mean", 5),
            ("same top-1 token %", "top1_rate", 2)]
    for name, field, digits in rows:
        values = [(column.get(field) if field in ("kl_mean", "top1_rate") else column.get("perplexity", {}).get(field))
                  for _, column in columns]
        values = [100 * v if field == "top1_rate" and v is not None else v for v in values]
        lines.append(f"| {name} | " + " | ".join("-" if v is None else f"{v:.{digits}f}" for v in values) + " |")
    lines += [f"- {note}" for note in section.get("notes", [])]
    return lines + [""]
