#!/usr/bin/env python
"""Where the 25% budget goes in an MLA + NVFP4 cache: k_rope kept 16-bit (nvfp4, FlashMLA's layout)
against k_rope in FP8 (nvfp4_fp8rope, a kvconvert format; this bench reads the NVFP4 calibration's scales through that
format's fake quantization).

For each one-shot MLA shape of SmolLM2-135M (8192 conversion tokens, fp32), on the essays (32 x 1024):
the conversion alone (bf16 cache), the latent in NVFP4 with k_rope 16-bit (calibrate's NVFP4 defaults
on --calib-tokens tokens), and the same latent with k_rope fake-quantized to FP8 e4m3 with the same
exported kv scale (amax / 448 of the whole row, as vLLM's FP8 MLA cache scales its k_rope). KL to the
source with an fp32 cache, transformers fp32, cache fake-quantized (kvconvert.eval.kv_quant).

    python scripts/bench_rope_fp8.py --shapes 224:64,272:32 --threads 2

Writes docs/bench_rope_fp8.json and the table between the rope_fp8 markers in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from bench_common import (DOCS, bench_rows, calibrated_candidate, command, parser, publish_rows, quant_eval_inputs,
                          write_block, write_json)


def rope_fp8_hook(checkpoint: Path):
    """Cache hook of an MLA checkpoint calibrated for NVFP4, read as nvfp4_fp8rope: the same scales, the
    latent NVFP4, k_rope FP8 with the row's kv scale (kvconvert's nvfp4_fp8rope format)."""
    import dataclasses

    from kvconvert.quant.hooks import fake_quant_hook
    from kvconvert.quant.layout import checkpoint_kv_layout
    from kvconvert.quant.scales import read_kv_scales

    return fake_quant_hook(checkpoint_kv_layout(checkpoint),
                           dataclasses.replace(read_kv_scales(checkpoint), kv_dtype="nvfp4_fp8rope"))


CACHE_FORMATS = {"bf16": "bf16", "nvfp4, k_rope 16-bit": "nvfp4", "nvfp4, k_rope fp8": "nvfp4_fp8rope"}


def cache_bytes(config: dict, rank: int, rope: int, cache: str) -> tuple[int, float]:
    """(KV bytes per token, fraction of the source's bf16) of one MLA shape with one of this bench's caches."""
    from kvconvert.kvmath import kv_bytes_per_token, kv_shape, mla_whatif

    source = kv_shape(config)
    n = kv_bytes_per_token(mla_whatif(source, rank, rope), CACHE_FORMATS[cache])
    return n, n / kv_bytes_per_token(source, "bf16")


def current_rows(doc: dict, info: dict | None = None, cmd: str | None = None) -> dict:
    """The quantized rows (k_rope 16-bit and FP8 on the same NVFP4 scales), for docs/BENCHMARKS.md's calibration table."""
    rows = [(f"SmolLM2-135M MLA {r['shape']} one-shot, {r['cache']} on scales calibrated for nvfp4 "
             f"({doc.get('calib_tokens', '?')} tokens; essays {doc.get('windows', '?')} x 1024): KL and ppl",
             f"KL {r['kl']:.4f}, ppl {r['ppl']:.2f} at {r['bytes_per_token']:.0f} KV bytes/token ({r['fraction']:.1%} of bf16)")
            for r in doc["rows"] if r["cache"] != "bf16"]
    return {"calibration": bench_rows(rows, info, cmd or doc.get("command"))}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shapes", default="224:64,272:32", help="one-shot MLA shapes rank:rope")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvconvert.checkpoint import read_config
    from kvconvert.mla.convert import convert_to_mla, validate_plan
    from kvconvert.mla.options import MLAOptions
    from kvconvert.quant.capture import load_hf_model
    from kvconvert.eval.kv_quant import evaluate_kv_quant
    from kvconvert.quant.hooks import identity_hook
    from kvconvert.quant.options import CalibrateOptions

    shapes = [tuple(map(int, s.split(":"))) for s in args.shapes.split(",")]
    src, _, windows, reference = quant_eval_inputs("smollm2-135m", args.windows)
    config = read_config(src)
    conversions = {(rank, rope): MLAOptions(rank=rank, rope_dim=rope, target="any", dtype="fp32", calib_tokens=8192)
                   for rank, rope in shapes}
    for options in conversions.values():  # every shape refused now, not after the first one's 10 minutes
        validate_plan(config, options)
    t0, rows = time.time(), []
    with tempfile.TemporaryDirectory(prefix="bench_rope_fp8_") as tmp:
        for rank, rope in shapes:
            mla, calibrated = Path(tmp) / f"mla-{rank}-{rope}", Path(tmp) / f"nvfp4-{rank}-{rope}"
            convert_to_mla(src, mla, conversions[rank, rope], overwrite=True, progress=False)
            _, (model, rope16_hook) = calibrated_candidate(
                mla, CalibrateOptions(kv_dtype="nvfp4", calib_tokens=args.calib_tokens), calibrated)
            models = {"bf16": (load_hf_model(mla), identity_hook), "nvfp4, k_rope 16-bit": (model, rope16_hook),
                      "nvfp4, k_rope fp8": (model, rope_fp8_hook(calibrated))}
            res = evaluate_kv_quant(reference, models, windows)
            for name in models:
                b, frac = cache_bytes(config, rank, rope, name)
                rows.append({"shape": f"{rank}+{rope}", "cache": name, "bytes_per_token": b, "fraction": frac,
                             "kl": res[name].kl, "ppl": res[name].ppl, "source_ppl": res["reference"].ppl})
                print(f"[{time.time() - t0:5.0f} s] MLA {rank}+{rope} {name}: {100 * frac:.1f}% KL {res[name].kl:.4f} "
                      f"ppl {res[name].ppl:.2f}", flush=True)
    doc = {"command": command(), "threads": args.threads, "seconds": time.time() - t0, "windows": args.windows,
           "calib_tokens": args.calib_tokens, "rows": rows}
    doc["bench_rows"] = current_rows(doc)
    write_json(DOCS / "bench_rope_fp8.json", doc, indent=1)
    publish_rows(doc, DOCS / "bench_rope_fp8.json")
    lines = [f"`{doc['command']}` ({doc['seconds']:.0f} s wall, {args.threads} threads). One-shot conversions, "
             f"essays {args.windows} x 1024; source ppl {rows[0]['source_ppl']:.2f}.", "",
             "| MLA shape | cache | KV bytes/token | of bf16 | KL | ppl |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['cache']} | {r['bytes_per_token']:.0f} | {100 * r['fraction']:.1f}% | {r['kl']:.4f} | "
              f"{r['ppl']:.2f} |" for r in rows]
    write_block("rope_fp8", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
