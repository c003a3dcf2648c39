#!/usr/bin/env python
"""Benchmark `kvconvert calibrate`: perplexity on the held-out essays with the KV cache fake-quantized.

For each configuration the real CLI path runs (calibrate -> checkpoint written to a temp folder),
then kvconvert.eval.kv_quant measures perplexity and token KL against the unquantized source on
the same windows (eval_windows: the Paul Graham essays, 32 x 1024 by default = the project's protocol).

Targets: FP8 E4M3 within +0.5% of the unquantized perplexity, NVFP4 within +3%.
Writes docs/bench_calibrate.json and prints a markdown table.

    python scripts/bench_calibrate.py --windows 8            # quick
    python scripts/bench_calibrate.py                        # full protocol (32 x 1024)
    python scripts/bench_calibrate.py --mla-path DIR         # also a DeepSeek-V3 (MLA) conversion
    python scripts/bench_calibrate.py --mla-path DIR --shaping-powers 0,0.125,0.25,0.375,0.5
        # only DIR, the latent shaping power swept; KL against DIR's own fp32 cache (the cache's own cost)
    python scripts/bench_calibrate.py --configs "(default)" --calib-data builtin,pydoc+wiki
        # every config calibrated on each text, side by side ("[text]" added to its name)
"""

from __future__ import annotations

import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import DOCS, bench_rows, calibrated_candidate, parser, publish_rows, quant_eval_inputs, write_json

TARGETS = {"fp8": 0.5, "nvfp4": 3.0}

# name -> CalibrateOptions overrides. "naive" = per-tensor amax/448, no rotation (the brief's baseline).
# "key phase" = per-RoPE-pair q/k phases folded into the weights (on by default when rotating);
# "V rotation" = Hadamard on V (nvfp4 default; on an MLA --mla-path, on the latent: pinned with latent_shaping 0).
# "(default)" = calibrate's defaults, which on an MLA checkpoint shape the latent instead (docs/calibrate.md).
CONFIGS = {
    "fp8 naive (amax, tensor)": {"kv_dtype": "fp8", "observer": "amax", "rotate": False},
    "fp8 amax + key phase": {"kv_dtype": "fp8", "observer": "amax"},
    "fp8 mse + key phase (default)": {"kv_dtype": "fp8", "observer": "mse"},
    "fp8 amax, head + key phase": {"kv_dtype": "fp8", "observer": "amax", "granularity": "head", "format": "vllm"},
    "fp8 mse, head + key phase": {"kv_dtype": "fp8", "observer": "mse", "granularity": "head", "format": "vllm"},
    "nvfp4 naive (amax, tensor)": {"kv_dtype": "nvfp4", "observer": "amax", "rotate": False},
    "nvfp4 V rotation + mse": {"kv_dtype": "nvfp4", "observer": "mse", "key_phase": False, "latent_shaping": 0},
    "nvfp4 V rotation + key phase + mse (default)": {"kv_dtype": "nvfp4", "observer": "mse"},
}


def shaping_sweep(args) -> dict:
    """One config per (format, power): calibrate's defaults with --latent-shaping P (0: no shaping,
    the latent Hadamard where the format folds one)."""
    if not args.mla_path:
        raise SystemExit("--shaping-powers needs --mla-path (latent shaping exists for MLA caches only)")
    return {f"{fmt} shaping P={float(p):g}": {"kv_dtype": fmt, "observer": "mse", "latent_shaping": float(p)}
            for fmt in args.shaping_formats.split(",") for p in args.shaping_powers.split(",")}


def per_text(configs: dict, texts: list[str]) -> dict:
    """Each config on each calibration text; names gain " [text]" when there is more than one."""
    if len(texts) == 1:
        return {name: {**c, "calib_data": texts[0]} for name, c in configs.items()}
    return {f"{name} [{text}]": {**c, "calib_data": text} for name, c in configs.items() for text in texts}


def parse_args():
    ap = parser(__doc__)
    ap.add_argument("--src", default="smollm2-135m")
    ap.add_argument("--mla-path", default=None, help="a converted DeepSeek-V3 (MLA) checkpoint to bench as well")
    ap.add_argument("--windows", type=int, default=32, help="eval windows (protocol: 32)")
    ap.add_argument("--window-len", type=int, default=1024, help="tokens per eval window (protocol: 1024)")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--calib-data", default="builtin",
                    help="comma list of calibration texts (calibrate --calib-data); with more than one, every "
                         "config runs on each")
    ap.add_argument("--search-tokens", type=int, default=1024, help="tokens replayed by the mse search")
    ap.add_argument("--configs", default=None, help="comma-separated substrings selecting configs")
    ap.add_argument("--shaping-powers", default=None, help="comma list of --latent-shaping powers: bench only "
                    "--mla-path, one config per power and --shaping-formats (replaces the config table)")
    ap.add_argument("--shaping-formats", default="nvfp4_fp8rope", help="KV formats of the shaping sweep")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(DOCS / "bench_calibrate.json"))
    return ap.parse_args()


def bench_model(src: str, label: str, args, configs: dict, workdir: Path) -> list[dict]:
    from kvconvert.eval.kv_quant import evaluate_kv_quant
    from kvconvert.quant.layout import checkpoint_kv_layout
    from kvconvert.quant.options import CalibrateOptions

    path, _, windows, reference = quant_eval_inputs(src, args.windows, args.window_len)
    is_mla = checkpoint_kv_layout(path).is_mla
    candidates, calib = {}, {}
    for name, overrides in configs.items():
        if is_mla and overrides.get("granularity") == "head":
            continue
        options = CalibrateOptions(calib_tokens=args.calib_tokens, search_tokens=args.search_tokens, **overrides)
        print(f"[{label}] calibrating: {name}", file=sys.stderr, flush=True)
        report, candidates[name] = calibrated_candidate(path, options, workdir / f"{label}-{len(calib)}")
        calib[name] = {"time_s": report["time_s"], "cpu_s": report.get("cpu_s"),
                       "seconds_per_million_tokens": report["seconds_per_million_tokens"],
                       "cpu_seconds_per_million_tokens": report.get("cpu_seconds_per_million_tokens"),
                       "tokens": report["calibration"]["tokens"], "threads": report["threads"]}
    t0 = time.perf_counter()
    results = evaluate_kv_quant(
        reference, candidates, windows,
        progress=lambda done, n: print(f"[{label}] eval window {done}/{n} ({time.perf_counter() - t0:.0f} s)",
                                       file=sys.stderr, flush=True))
    ref = results["reference"]
    rows = [{"model": label, "config": "unquantized (fp32 cache)", "kv_dtype": None, "ppl": ref.ppl,
             "delta_pct": 0.0, "kl": 0.0, "target_pct": None, "meets_target": None}]
    for name, res in results.items():
        if name == "reference":
            continue
        kv_dtype = configs[name]["kv_dtype"]
        delta = (res.ppl / ref.ppl - 1) * 100
        rows.append({"model": label, "config": name, "kv_dtype": kv_dtype, "calib_data": configs[name]["calib_data"],
                     "ppl": res.ppl, "delta_pct": delta,
                     "kl": res.kl, "target_pct": TARGETS.get(kv_dtype),
                     "meets_target": delta <= TARGETS[kv_dtype] if kv_dtype in TARGETS else None,
                     "calibration": calib[name]})
    return rows


def markdown(rows: list[dict], args) -> str:
    header = (f"Held-out essays, {args.windows} x {args.window_len} tokens, KV cache fake-quantized "
              f"(calibration: {args.calib_tokens} tokens of {args.calib_data.replace(',', ' / ')}).")
    lines = [header, "",
             "| model | config | ppl | vs fp32 | token KL | target | calibration time (wall s) |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        target = "" if r["target_pct"] is None else (
            f"<= +{r['target_pct']}% {'met' if r['meets_target'] else 'MISSED'}")
        speed = "" if "calibration" not in r else f"{r['calibration']['time_s']['total']:.0f}"
        lines.append(f"| {r['model']} | {r['config']} | {r['ppl']:.3f} | {r['delta_pct']:+.2f}% | "
                     f"{r['kl']:.5f} | {target} | {speed} |")
    return "\n".join(lines)


def current_rows(payload: dict, info: dict | None = None, cmd: str | None = None) -> dict:
    """The rows of calibrate's defaults for docs/BENCHMARKS.md's calibration table (bench_common.bench_rows)."""
    p = payload["protocol"]
    rows = [(f"{r['model']}: {r['config'].split(' [')[0]}, {p['calib_tokens']} calibration tokens of "
             f"{r.get('calib_data') or p['calib_data']} ({p['windows']} x {p['window_len']} essay tokens)",
             f"ppl {r['delta_pct']:+.2f}% vs an unquantized cache ({r['ppl']:.3f}), token KL {r['kl']:.5f}")
            for r in payload["rows"] if "(default)" in r["config"]]
    return {"calibration": bench_rows(rows, info, cmd)}


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    configs = CONFIGS if not args.shaping_powers else shaping_sweep(args)
    if args.configs:
        keys = [k.strip() for k in args.configs.split(",")]
        configs = {n: c for n, c in configs.items() if any(k in n for k in keys)}
    configs = per_text(configs, [t.strip() for t in args.calib_data.split(",") if t.strip()])
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_calibrate_") as tmp:
        if not args.shaping_powers:
            rows += bench_model(args.src, args.src, args, configs, Path(tmp))
        if args.mla_path:
            rows += bench_model(args.mla_path, "MLA: " + Path(args.mla_path).name, args, configs, Path(tmp))
    table = markdown(rows, args)
    payload = {"protocol": {"eval": "Paul Graham essays (kvconvert.data.eval_windows)", "windows": args.windows,
                            "window_len": args.window_len, "calib_data": args.calib_data, "calib_tokens": args.calib_tokens},
               "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
               "rows": rows, "markdown": table}
    payload["bench_rows"] = current_rows(payload)
    write_json(args.out, payload)
    publish_rows(payload, args.out)
    print(table)


if __name__ == "__main__":
    main()
