"""The end of the README's main job (scripts/demo.sh): the candidates it built side by side (KV bytes
per token, quality against the source, the engines that serve them, the gate), a picture, and one
sentence that says what was shipped and what was traded.

    python scripts/demo_summary.py --policy default --png out/demo/summary.png \
        "kvconvert plan, 50%, vLLM=out/demo/plan50" "kvconvert plan, 33%, llama.cpp=out/demo/plan33"

Each candidate is LABEL=PIPELINE_OUT (a `kvconvert pipeline --out` folder: its report/report.json, the
validated model and, for llama.cpp, the GGUF). The smallest candidate whose gate passes is the one shipped.

    python scripts/demo_summary.py --machine

prints, before the job starts, the vector units torch uses on this CPU (AVX2 / AVX-512 / AMX:
kvconvert.eval.runner.cpu_kind) and the time the job is expected to take on that kind (EXPECTED_SECONDS).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from kvconvert.eval.gate import load_policy
from kvconvert.kvformat import kv_pair
from kvconvert.kvmath import kv_bytes_per_token, kv_shape
from kvconvert.pipeline import _policy_path, llamacpp_flags
from kvconvert.targets import TARGETS


# The main job's time after setup on 2 cores, per CPU kind (cpu_kind().name): (seconds, how it was measured).
# docs/BENCHMARKS.md, "The README's main job" has the stages behind each number; update both together.
EXPECTED_SECONDS = {
    "AMX": (None, "not measured with this suite; the main job before the 4096-token prompts took 265 s on a quiet "
                  "2-core Xeon with AMX"),
    "AVX-512": (282, "measured on a quiet 2-core AMD EPYC (Zen 4) with every source result measured in the run"),
    "AVX2": (None, "not measured with this suite; an earlier main job (bf16 compute) took 1029 s on a 2-core "
                   "AVX2-only EPYC"),
}


def machine_banner() -> str:
    """What the CPU runs (cpu_kind) and the main job's expected time on it (EXPECTED_SECONDS)."""
    from kvconvert.eval.runner import cpu_kind

    kind = cpu_kind()
    seconds, how = EXPECTED_SECONDS.get(kind.name, (None, "no measurement for this kind"))
    expected = f"about {seconds} s ({seconds / 60:.1f} min)" if seconds else "not known"
    bf16 = "bf16 weights run in bf16" if kind.native_bf16 else "bf16 weights run in fp32 (no native bf16)"
    return (f"  This machine: {kind.describe()}; {bf16}.\n"
            f"  Expected time after setup on 2 cores of this kind: {expected}: {how}.")


def _config(report: dict, model: str) -> dict:
    """config.json of the report's `model` (source or candidate)."""
    return json.loads((Path(report[model]["path"]) / "config.json").read_text())


def _gate(report_path: Path, policy_file: str) -> tuple[bool, str]:
    """The real `kvconvert gate` (exit 0 = pass, 1 = fail; anything else is an error, not a verdict) and its
    verdict line, which says which kind of pass it is (every metric shown within its threshold, or
    INCONCLUSIVE metrics let through by the policy's on_inconclusive: pass)."""
    proc = subprocess.run([sys.executable, "-m", "kvconvert.cli", "gate", "--report", str(report_path),
                           "--policy", policy_file], capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"kvconvert gate failed on {report_path}:\n{proc.stderr}")
    return proc.returncode == 0, proc.stdout.strip().splitlines()[-1]


def _gate_word(row: dict) -> str:
    """PASS, PASS+INCONCL. (a pass with undecided metrics the policy allows) or FAIL."""
    if not row["gate"]:
        return "FAIL"
    return "PASS+INCONCL." if "INCONCLUSIVE" in row["gate_line"] else "PASS"


def _engines(report: dict) -> str:
    """The engines serving the candidate's KV format (kvconvert.kvformat) and, for MLA, its latent shape."""
    arch, kv = report["candidate"]["architecture"], report["candidate"]["kv_dtype"]
    mla = arch.startswith("Deepseek")
    engines = kv_pair(kv).served_by(mla=mla)  # one format or a K/V pair (q5_0/iq4_nl)
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
    est = report["estimates"]
    return {"label": label, "bytes": cand, "fraction": cand / src, "ppl_pct": m["perplexity"]["delta_pct"],
            "ppl_low": est["perplexity_increase_pct"]["low"], "ppl_high": est["perplexity_increase_pct"]["high"],
            "kl": m["kl_mean"]["candidate"], "kl_low": est["kl_mean"]["low"], "kl_high": est["kl_mean"]["high"],
            "serve": _serve(out, report), "passkey_drop": _drop(m, "passkey_accuracy"),
            "niah_drop": _drop(m, "niah_accuracy"), "longbench_drop": _drop(m, "longbench_avg"),
            "engines": _engines(report),
            **dict(zip(("gate", "gate_line"), _gate(report_path, policy_file))), "suite": report["suite"]["name"]}


def _serve(out: Path, report: dict) -> str | None:
    """The llama-cli command that serves the pipeline's GGUF (its export stage), or None."""
    log = json.loads((out / "pipeline.json").read_text()).get("stages", []) if (out / "pipeline.json").is_file() else []
    for stage in log:
        if stage["stage"] == "export":
            words = stage["command"].split()
            return llamacpp_flags(report["candidate"]["kv_dtype"], words[words.index("--out") + 1])
    return None


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
              f"{_fmt(r['longbench_drop'], '+.1f'):>8}pt  {_gate_word(r):<16} {r['engines']}")
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


def verdict(rows: list[dict], thresholds=None) -> str:
    """The candidate shipped (the smallest whose gate passes), how it is served, and what it traded: against each
    larger candidate that passes (the quality given up for the bytes) and the smallest that fails (what a
    smaller cache would cost). A point estimate past a threshold is said, with the gate's rule."""
    shipped = [r for r in rows if r["gate"]]
    if not shipped:
        return "No candidate passed the gate: nothing is shipped; see the reports for what failed."
    best = min(shipped, key=lambda r: r["fraction"])
    text = (f"Shipped: {best['label']} - the KV cache at {best['fraction']:.0%} of the source's bf16 bytes "
            f"({best['bytes']} B/token), perplexity {sig(best['ppl_pct'], sign=True)}% "
            f"[{sig(best['ppl_low'], sign=True)}, {sig(best['ppl_high'], sign=True)}], KL {sig(best['kl'])} "
            f"[{sig(best['kl_low'])}, {sig(best['kl_high'])}]{_longbench_text(best)}: the gate passes"
            f"{_margin(best, thresholds)}. The gate's verdict: {best['gate_line']}.")
    if best.get("serve"):
        text += f" Serve it with: {best['serve']}."
    for r in [r for r in shipped if r["fraction"] > best["fraction"]]:
        text += (f" Traded against {r['label']} ({r['fraction']:.0%}, KL {sig(r['kl'])}, perplexity "
                 f"{sig(r['ppl_pct'], sign=True)}%): {1 - best['fraction'] / r['fraction']:.0%} fewer KV bytes for "
                 f"KL {sig(best['kl'] / r['kl'], 2)}x as large.")
    smaller = [r for r in rows if r["fraction"] < best["fraction"] and not r["gate"]]
    if smaller:
        s = min(smaller, key=lambda r: r["fraction"])
        text += (f" Smaller: {s['label']} would cut it to {s['fraction']:.0%} but costs perplexity "
                 f"{sig(s['ppl_pct'], sign=True)}% and KL {sig(s['kl'])}{_longbench_text(s)}, past the gate.")
    return text


def _margin(row: dict, thresholds) -> str:
    """'' when both point estimates are inside the thresholds, else the gate's rule that lets it pass."""
    if thresholds is None:
        return ""
    over = [name for name, value, limit in (("perplexity", row["ppl_pct"], thresholds.perplexity_increase_pct),
                                            ("KL", row["kl"], thresholds.kl_mean))
            if limit is not None and value > limit]
    if not over:
        return " (both point estimates inside the thresholds)"
    return (f" on the gate's rule (it fails a metric when its 95% interval lies wholly past the threshold): the "
            f"{' and '.join(over)} point estimate{'s are' if len(over) > 1 else ' is'} past the threshold")


def _longbench_text(row: dict) -> str:
    drop = row["longbench_drop"]
    # the score's change, not the drop, so the sign reads as better (+) or worse (-); 0.0 - 0.0 is +0.0
    return "" if drop is None else f", LongBench score {0.0 - drop:+.1f} points against the source"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("candidates", nargs="*", help="LABEL=PIPELINE_OUT, in the order to show them")
    ap.add_argument("--policy", default="default")
    ap.add_argument("--png", type=Path)
    ap.add_argument("--machine", action="store_true", help="print the CPU kind and the expected time, then exit")
    args = ap.parse_args()
    if args.machine:
        print(machine_banner())
        return 0
    if not args.candidates or args.png is None:
        ap.error("give the candidates (LABEL=PIPELINE_OUT) and --png, or --machine")
    policy_file = _policy_path(args.policy)
    rows = [summarize(label, Path(folder), policy_file)
            for label, _, folder in (item.partition("=") for item in args.candidates)]
    print_table(rows, args.policy)
    thresholds = load_policy(Path(policy_file)).thresholds
    plot(rows, args.png, thresholds.kl_mean)
    print(f"\nPicture: {args.png}")
    print("\n" + verdict(rows, thresholds))
    return 0 if any(r["gate"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
