"""Stock llama.cpp's KV caches on kvconvert's GGUF exports: perplexity, KL and top-1 agreement against a float
cache on the same essay windows, the way `kvconvert validate --engine llamacpp` scores them
(kvconvert.engines.llamacpp: llama.cpp's C API in a worker process).

    python scripts/bench_llamacpp.py --src smollm2-135m --mla out/mla320 --windows 8 --window-len 1024

- the source exported as an f32 GGUF (LLAMA): f32 cache (the reference) against q8_0 and q4_0 K+V caches,
  each with llama.cpp's Hadamard rotation (its default) and without (LLAMA_ATTN_ROT_DISABLE=1); and the
  f32 cache against transformers (fp32) on the same windows;
- with --mla, a `kvconvert mla` output exported as stored (DEEPSEEK2): f16 cache (llama.cpp's default, the
  reference) against q8_0 and q4_0 latents, and its f32 cache against transformers.
Results go to --out (JSON, with "bench_rows" for docs/BENCHMARKS.md's current tables; this script does not
edit BENCHMARKS.md). Needs scripts/setup_llamacpp.sh. Threads: llama.cpp's (default: the CPUs available).
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import closing
from pathlib import Path

from bench_common import bench_rows, command, parser, run_info, stopwatch, write_json


def score(contexts, windows, threads) -> dict:
    from kvconvert.engines.llamacpp import LlamaCppScorer
    from kvconvert.token_stats import TokenSums

    totals: dict = {}
    with stopwatch() as clock, LlamaCppScorer(contexts, n_ctx=len(windows[0]), threads=threads) as engine:
        info = engine.info()
        for i, ids in enumerate(windows):
            for name, sums in engine.score(ids, reference=contexts[0].name).items():
                totals[name] = totals.get(name, TokenSums()) + sums
            print(f"llama.cpp: window {i + 1}/{len(windows)}", file=sys.stderr)
    reference = totals[contexts[0].name]
    rows = {name: {"cache": c.cache, "rotation": c.rotation, "ppl": s.ppl, "ppl_ratio": s.ppl / reference.ppl,
                   "kl_mean": s.kl_mean, "top1_pct": 100 * s.top1_rate, "tokens": s.tokens}
            for (name, s), c in zip(totals.items(), contexts)}
    rows[contexts[0].name].update(kl_mean=None, top1_pct=None)
    return {"contexts": rows, "seconds": clock["seconds"], "model": info["contexts"][contexts[0].name]["model"],
            "system_info": info["system_info"]}


def transformers_ppl(folder, windows) -> float:
    from kvconvert.eval.runner import TransformersRunner
    from kvconvert.token_stats import TokenSums, window_sums

    with closing(TransformersRunner(folder, kv_dtype="fp32")) as runner:
        return sum((window_sums(runner.logits(w), w) for w in windows), TokenSums()).ppl


def caches(gguf: Path, reference: str, quantized: tuple[str, ...], rotations: tuple[bool, ...]):
    from kvconvert.engines.llamacpp import LlamaCppContext

    out = [LlamaCppContext(reference, str(gguf), cache=reference)]
    for q in quantized:
        out += [LlamaCppContext(f"{q}{'' if rot else ' unrotated'}", str(gguf), cache=q, flash_attn="on",
                                rotation=rot) for rot in rotations]
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--src", default="smollm2-135m")
    p.add_argument("--mla", default=None, help="a `kvconvert mla` output folder (its latent in llama.cpp's K cache)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers reference perplexity")
    p.add_argument("--out", default="docs/bench_llamacpp.json")
    args = p.parse_args()

    from kvconvert.checkpoint import load_tokenizer
    from kvconvert.checkpoint.gguf_export import export_gguf
    from kvconvert.engines.gguf_options import GGUFExportOptions
    from kvconvert.data import eval_windows
    from kvconvert.sources import resolve_source

    src = resolve_source(args.src)
    windows = list(eval_windows(load_tokenizer(src), args.windows, args.window_len))
    results = {"command": command(), **run_info(), "windows": args.windows, "window_len": args.window_len}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as work:
        gguf = export_gguf(src, Path(work) / "source.gguf", GGUFExportOptions(outtype="f32")).out
        source = score(caches(gguf, "f32", ("q8_0", "q4_0"), (True, False)), windows, args.threads)
        if not args.no_transformers:
            source["transformers_ppl"] = transformers_ppl(src, windows)
        results["source"] = source
        for name, r in source["contexts"].items():
            if r["kl_mean"] is not None:
                rows.append((f"llama.cpp SmolLM2 f32 GGUF, {name} cache vs f32: KL / PPL ratio / same top-1",
                             f"{r['kl_mean']:.4f} / x{r['ppl_ratio']:.3f} / {r['top1_pct']:.1f}%"))
        if args.mla:
            mla_gguf = export_gguf(args.mla, Path(work) / "mla.gguf").out
            mla = score(caches(mla_gguf, "f16", ("q8_0", "q4_0"), (True,)), windows, args.threads)
            f32 = score(caches(mla_gguf, "f32", (), ()), windows, args.threads)
            mla["f32_cache_ppl"] = f32["contexts"]["f32"]["ppl"]
            if not args.no_transformers:
                mla["transformers_ppl"] = transformers_ppl(args.mla, windows)
            results["mla"] = {"folder": str(args.mla), **mla}
            for name, r in mla["contexts"].items():
                if r["kl_mean"] is not None:
                    rows.append((f"llama.cpp SmolLM2 MLA 256+64 GGUF, {name} latent vs f16: KL / PPL ratio / same top-1",
                                 f"{r['kl_mean']:.4f} / x{r['ppl_ratio']:.3f} / {r['top1_pct']:.1f}%"))
    results["bench_rows"] = {"llamacpp": bench_rows(rows)}
    write_json(args.out, results)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
