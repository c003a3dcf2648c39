#!/usr/bin/env python
"""How far can any key transform go? FP8 / NVFP4 KV with an ideal online rotation of post-RoPE K.

A stock engine stores RoPE'd keys as they come, so a checkpoint can only change them by what commutes
with RoPE (kvconvert's per-pair phases). An engine that rotated q and k by a full Hadamard H after
RoPE (not expressible in a stock checkpoint) would store Q(k H) and score q H . Q(k H), which equals
q . (Q(k H) H^T): so the cache hook k -> Q(k H) H^T measures that engine exactly. That is a lower
bound for what any rotation of the keys can reach, to compare the calibrate defaults against.

    python scripts/bench_key_floor.py --windows 8 --threads 1

Writes docs/bench_key_floor.json and prints a markdown table (same windows, one run).
"""

from __future__ import annotations

import torch
from bench_common import DOCS, bench_rows, parser, publish_rows, quant_eval_inputs, write_json


def parse_args():
    ap = parser(__doc__)
    ap.add_argument("--src", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(DOCS / "bench_key_floor.json"))
    return ap.parse_args()


def rotated_key_amax(model, hadamard: torch.Tensor, windows: torch.Tensor) -> dict[int, float]:
    """Per layer amax of the rotated post-RoPE keys (k @ H) over the calibration windows."""
    from kvconvert.quant.capture import run_with_hook

    amax: dict[int, float] = {}

    def observe(layer, k, v):
        amax[layer] = max(amax.get(layer, 0.0), float((k @ hadamard).abs().max()))
        return k, v
    run_with_hook(model, windows, observe, batch_size=4)
    return amax


def ideal_rotation_hook(kv_dtype: str, hadamard: torch.Tensor, key_amax: dict[int, float], scales):
    """Cache hook: K quantized in the rotated basis (per-tensor amax/448), V as calibrated."""
    from kvconvert.quant.fake_quant import fake_quant, scale_from_amax

    def hook(layer, k, v):
        k_scale = scale_from_amax(torch.tensor(key_amax[layer]), kv_dtype).float()
        return (fake_quant(k @ hadamard, kv_dtype, k_scale) @ hadamard.T,
                fake_quant(v, kv_dtype, scales.scale(layer, "v")))
    return hook


def current_rows(payload: dict, info: dict | None = None, cmd: str | None = None) -> dict:
    """The bound's rows (the non-stock key rotation) for docs/BENCHMARKS.md's calibration table."""
    rows = [(f"{payload.get('src', 'smollm2-135m')}: {r['config']}, {payload['calib_tokens']} calibration tokens "
             f"({payload['windows']} x 1024 essay tokens)", f"ppl {r['delta_pct']:+.2f}%, token KL {r['kl']:.5f}")
            for r in payload["rows"] if "not stock" in r["config"]]
    return {"calibration": bench_rows(rows, info, cmd)}


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    from kvconvert.data import calibration_windows
    from kvconvert.quant.calibrate import CalibrationSettings, calibrate_model
    from kvconvert.quant.capture import load_hf_model
    from kvconvert.eval.kv_quant import evaluate_kv_quant
    from kvconvert.quant.hooks import fake_quant_hook
    from kvconvert.quant.layout import checkpoint_kv_layout
    from kvconvert.quant.rotate import block_hadamard
    from kvconvert.sources import resolve_source

    layout = checkpoint_kv_layout(resolve_source(args.src))
    if layout.is_mla:
        raise SystemExit("this bound is for GQA/MHA keys (an MLA latent can already be rotated freely)")
    path, tokenizer, windows, reference = quant_eval_inputs(args.src, args.windows)
    calib = calibration_windows(tokenizer, "builtin", args.calib_tokens, 512)
    hadamard = block_hadamard(layout.head_dim, layout.head_dim, seed=0).float()
    candidates = {}
    for kv_dtype in ("fp8", "nvfp4"):
        for label, settings in (("naive (amax, no rotation)", CalibrationSettings(kv_dtype, observer="amax", rotate=False)),
                                ("amax + key phase", CalibrationSettings(kv_dtype, observer="amax", value_rotation=False))):
            model = load_hf_model(path)
            result = calibrate_model(model, layout, calib, settings)
            candidates[f"{kv_dtype} {label}"] = (model, fake_quant_hook(layout, result.scales))
            if label.startswith("naive"):
                amax = rotated_key_amax(model, hadamard, calib[:8])
                candidates[f"{kv_dtype} ideal online K Hadamard (not stock)"] = (
                    model, ideal_rotation_hook(kv_dtype, hadamard, amax, result.scales))
    results = evaluate_kv_quant(reference, candidates, windows)
    ref = results["reference"]
    rows = [{"config": name, "ppl": r.ppl, "delta_pct": (r.ppl / ref.ppl - 1) * 100, "kl": r.kl}
            for name, r in results.items()]
    lines = [f"{args.src}, {args.windows} x 1024 essay tokens, V quantized with its amax scale in every row.", "",
             "| config | ppl | vs unquantized | token KL |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['config']} | {r['ppl']:.3f} | {r['delta_pct']:+.2f}% | {r['kl']:.5f} |" for r in rows]
    table = "\n".join(lines)
    payload = {"src": args.src, "windows": args.windows, "calib_tokens": args.calib_tokens, "threads": args.threads,
               "rows": rows, "markdown": table}
    payload["bench_rows"] = current_rows(payload)
    write_json(args.out, payload)
    publish_rows(payload, args.out)
    print(table)


if __name__ == "__main__":
    main()
