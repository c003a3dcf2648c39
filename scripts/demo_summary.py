"""The end of the README's main job (scripts/demo.sh): the candidates it built side by side (KV bytes
per token, quality against the source, the engines that serve them, the gate), a picture, and one
sentence that says what was shipped and what was traded.

    python scripts/demo_summary.py --policy default --png out/demo/summary.png \
        "MLA 256+64 + FP8=out/demo/mla320-fp8" "FP8 KV=out/demo/fp8"

Each candidate is LABEL=PIPELINE_OUT (a `kvconvert pipeline --out` folder: its report/report.json
and the validated model). The last candidate whose gate passes is the one shipped.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from kvconvert.eval.gate import load_policy
from kvconvert.kvformat import kv_format
from kvconvert.kvmath import kv_bytes_per_token, kv_shape
from kvconvert.pipeline import _policy_path
from kvconvert.targets import TARGETS


def _config(report: dict, model: str) -> dict:
    """config.json of the report's `model` (source or candidate)."""
    return json.loads((Path(report[model]["path"]) / "config.json").read_text())


def _gate(report_path: Path, policy_file: str) -> bool:
    """The real `kvconvert gate` (exit 0 = pass, 1 = fail; anything else is an error, not a verdict)."""
    proc = subprocess.run([sys.executable, "-m", "kvconvert.cli", "gate", "--report", str(report_path),
                           "--policy", policy_file], capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"kvconvert gate failed on {report_path}:\n{proc.stderr}")
    return proc.returncode == 0


def _engines(report: dict) -> str:
    """The engines serving the candidate's KV format (kvconvert.kvformat) and, for MLA, its latent shape."""
    arch, kv = report["candidate"]["architecture"], report["candidate"]["kv_dtype"]
    mla = arch.startswith("Deepseek")
    engines = kv_format(kv).served_by(mla=mla)
    if mla:
        cfg = _config(report, "candidate")
        engines = [e for e in engines if TARGETS[e].serves(cfg["kv_lora_rank"], cfg["qk_rope_head_dim"])]
    return ", ".join(engines)


def summarize(label: str, out: Path, policy_file: str) -> dict:
    report_path = out / "report" / "report.json"
    report = json.loads(report_path.read_text())
    m = report["metrics"]
    # KV bytes per token of the candidate and of the source in bf16, from the models' configs
    cand = kv_bytes_per_token(kv_shape(_config(report, "candidate")), report["candidate"]["kv_dtype"])
    src = kv_bytes_per_token(kv_shape(_config(report, "source")), "bf16")
    return {"label": label, "bytes": cand, "fraction": cand / src, "ppl_pct": m["perplexity"]["delta_pct"],
            "kl": m["kl_mean"]["candidate"], "passkey_drop": _drop(m, "passkey_accuracy"),
            "niah_drop": _drop(m, "niah_accuracy"), "longbench_drop": _drop(m, "longbench_avg"),
            "engines": _engines(report),
            "gate": _gate(report_path, policy_file), "suite": report["suite"]["name"]}


def _drop(metrics: dict, name: str) -> float | None:
    entry = metrics.get(name)
    return None if entry is None else entry["source"] - entry["candidate"]


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def sig(value: float, digits: int = 2, sign: bool = False) -> str:
    """`value` with `digits` significant digits and at least one decimal: +0.043, +11.0, 0.0057, 0.100 (a small
    change is never rounded to 0: +0.04% stays +0.040, not +0.0)."""
    if value == 0 or not math.isfinite(value):
        return format(value, "+.1f" if sign else ".1f")
    decimals = max(1, digits - 1 - math.floor(math.log10(abs(value))))
    return format(value, f"{'+' if sign else ''}.{decimals}f")


def print_table(rows: list[dict], policy: str) -> None:
    print(f"\n{'candidate':<26} {'KV B/token':>10} {'of bf16':>8} {'ppl':>8} {'KL':>7} {'passkey':>8} {'NIAH':>7}"
          f" {'LongBench':>10}  {'gate (' + policy + ')':<16} served by")
    for r in rows:
        print(f"{r['label']:<26} {r['bytes']:>10d} {r['fraction']:>7.0%} {sig(r['ppl_pct'], sign=True):>7}% "
              f"{sig(r['kl']):>7} {_fmt(r['passkey_drop'], '+.0f'):>6}pp {_fmt(r['niah_drop'], '+.0f'):>5}pp "
              f"{_fmt(r['longbench_drop'], '+.1f'):>8}pt  {'PASS' if r['gate'] else 'FAIL':<16} {r['engines']}")
    print("(ppl: perplexity increase on the essays; KL: mean token KL(source || candidate); passkey / NIAH: "
          "accuracy drop in points; LongBench: drop of the mean task score (0-100) on the suite's subset; all against "
          "the source on identical inputs)")


def plot(rows: list[dict], path: Path, kl_limit: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for r in rows:
        color = "tab:green" if r["gate"] else "tab:red"
        ax.scatter(100 * r["fraction"], r["kl"], s=80, color=color, zorder=3)
        ax.annotate(f"{r['label']}\nppl {sig(r['ppl_pct'], sign=True)}%, gate {'PASS' if r['gate'] else 'FAIL'}",
                    (100 * r["fraction"], r["kl"]), textcoords="offset points", xytext=(8, 6), fontsize=8)
    ax.scatter([100], [0], s=80, color="gray", zorder=3)
    ax.annotate("source (bf16 KV)", (100, 0), textcoords="offset points", xytext=(-90, 8), fontsize=8)
    ax.set_xlabel("KV-cache bytes per token, % of the source in bf16")
    ax.set_ylabel("mean token KL(source || candidate), nats")
    if kl_limit is not None:
        ax.axhline(kl_limit, color="tab:gray", ls="--", lw=1)
        ax.annotate(f"gate: KL <= {kl_limit}", (2, kl_limit), textcoords="offset points", xytext=(0, 4), fontsize=8)
    top = max([r["kl"] for r in rows] + [kl_limit or 0])
    ax.set_xlim(0, 110)
    ax.set_ylim(-0.05 * top, 1.4 * top)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"Quality per KV byte ({rows[0]['suite']} suite); green = passes the gate", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def verdict(rows: list[dict]) -> str:
    shipped = [r for r in rows if r["gate"]]
    if not shipped:
        return "No candidate passed the gate: nothing is shipped; see the reports for what failed."
    best = shipped[-1]
    text = (f"Shipped: {best['label']} - the KV cache at {best['fraction']:.0%} of the source's bf16 bytes "
            f"({best['bytes']} B/token), perplexity {sig(best['ppl_pct'], sign=True)}%, KL {sig(best['kl'])}"
            f"{_longbench_text(best)}: the gate passes.")
    smaller = [r for r in rows if r["fraction"] < best["fraction"] and not r["gate"]]
    if smaller:
        s = min(smaller, key=lambda r: r["fraction"])
        text += (f" Traded: {s['label']} would cut it to {s['fraction']:.0%} but costs perplexity "
                 f"{sig(s['ppl_pct'], sign=True)}% and KL {sig(s['kl'])}{_longbench_text(s)} one-shot, past the gate; "
                 "healing it needs a GPU (recipes/*-gpu.yaml, docs/BENCHMARKS.md).")
    return text


def _longbench_text(row: dict) -> str:
    drop = row["longbench_drop"]
    # the score's change, not the drop, so the sign reads as better (+) or worse (-); 0.0 - 0.0 is +0.0
    return "" if drop is None else f", LongBench score {0.0 - drop:+.1f} points against the source"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("candidates", nargs="+", help="LABEL=PIPELINE_OUT, in the order to show them")
    ap.add_argument("--policy", default="default")
    ap.add_argument("--png", type=Path, required=True)
    args = ap.parse_args()
    policy_file = _policy_path(args.policy)
    rows = [summarize(label, Path(folder), policy_file)
            for label, _, folder in (item.partition("=") for item in args.candidates)]
    print_table(rows, args.policy)
    plot(rows, args.png, load_policy(Path(policy_file)).thresholds.kl_mean)
    print(f"\nPicture: {args.png}")
    print("\n" + verdict(rows))
    return 0 if any(r["gate"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
