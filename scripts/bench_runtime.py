#!/usr/bin/env python
"""Benchmark the bundled runtime against transformers' generate, side by side in one run.

    python scripts/bench_runtime.py --quick                      # minutes: batch 1 and 8 at 512 tokens
    python scripts/bench_runtime.py --mla out/smollm2-mla-25      # full grid, source and its MLA conversion

Measures (CPU, fp32 compute):
  * decode tokens/s at batch x context (default 1, 8, 32 x 512, 2K, 8K) for the source model
    (SmolLM2-135M, GQA) and, when --mla is given, its MLA conversion, both in the runtime, against
    transformers' generate on the source (same prompts lengths, greedy, EOS ignored). Decode rate =
    batch x decode tokens / time from the first generated token to the last (prefill excluded).
  * KV bytes per token (exact, from the runtime's cache layout) per kv dtype.
  * how many concurrent 2K-token requests fit a fixed KV memory: paged (the runtime's BlockManager
    allocating blocks) vs reserving max_model_len tokens per request up front.
Writes docs/bench_runtime.json and prints a markdown table. Configurations that would not fit in
this machine's RAM are recorded as skipped, with the estimate.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_common import DOCS, bench_rows, parser, publish_rows, write_json

from kvconvert.checkpoint import read_config
from kvconvert.kvmath import kv_bytes_per_token, kv_shape, parse_size

REQUEST_TOKENS = 2048


def parse_args(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--source", default="smollm2-135m", help="source model folder or built-in name")
    ap.add_argument("--mla", default=None, help="MLA conversion of the source (HF folder), optional")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--kv-dtype", default="bf16", help="runtime KV storage for the speed runs")
    ap.add_argument("--kv-memory", default="1G", type=lambda text: parse_size(text, bare_unit=1),
                    help="fixed KV memory for the concurrency count (bare number: bytes)")
    ap.add_argument("--request-tokens", type=int, default=REQUEST_TOKENS, help="request length for that count")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="batch 1 and 8 at 512 tokens, 8 decode tokens")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers' generate")
    ap.add_argument("--out", default=str(DOCS / "bench_runtime.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.decode_tokens = "1,8", "512", 8
    args.batches = [int(b) for b in args.batches.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    return args


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def prompts_for(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (no shared prefix, so no prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]


# ---------------------------------------------------------------------------------------- runtime
def runtime_decode(llm, prompts, n_decode: int) -> float:
    """Decode tokens/s of the runtime: prefill everything, then time n_decode steps."""
    from kvconvert.runtime import SamplingParams

    params = SamplingParams(max_tokens=n_decode + 1, greedy=True, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    while llm.scheduler.waiting or any(s.num_generated == 0 for s in llm.scheduler.running):
        llm.step()
    start, steps = time.perf_counter(), 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    elapsed = time.perf_counter() - start
    for i in ids:
        llm.take_output(i)
    return len(prompts) * steps / elapsed


# ---------------------------------------------------------------------------------------- transformers
def transformers_decode(model, prompts, n_decode: int) -> float:
    ids = torch.tensor(prompts)
    t = []  # timestamps: generate() streams the prompt, then each token: [prompt, token 1 (after prefill), ...]
    clock = SimpleNamespace(put=lambda _: t.append(time.perf_counter()), end=lambda: None)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_decode + 1,
                       min_new_tokens=n_decode + 1, do_sample=False, streamer=clock, pad_token_id=0)
    return len(prompts) * (len(t) - 2) / (t[-1] - t[1])


# ---------------------------------------------------------------------------------------- KV math
def kv_table(paths: dict[str, Path], kv_memory: int, request_tokens: int = REQUEST_TOKENS,
             block_size: int = 16) -> tuple[list, list]:
    """KV bytes/token per model and dtype; concurrent requests of request_tokens in kv_memory,
    paged (blocks as needed) vs reserving max_model_len tokens per request."""
    from kvconvert.runtime.block_manager import BlockManager
    from kvconvert.runtime.kv_cache import bytes_per_token
    from kvconvert.runtime.models import kv_layout

    sizes, fits = [], []
    base = None
    for name, path in paths.items():
        config = read_config(path)
        layout = kv_layout(config)
        max_len = config["max_position_embeddings"]
        for kv_dtype in ("bf16", "fp8", "nvfp4"):
            bpt = bytes_per_token(layout, kv_dtype)
            base = base or bpt
            sizes.append({"model": name, "kv_dtype": kv_dtype, "bytes_per_token": bpt,
                          "fraction_of_source_bf16": round(bpt / base, 4)})
            num_blocks = kv_memory // (bpt * block_size)
            fits.append({"model": name, "kv_dtype": kv_dtype, "kv_memory_bytes": kv_memory,
                         "request_tokens": request_tokens, "max_model_len": max_len,
                         "paged": count_paged(BlockManager(max(num_blocks, 1), block_size), num_blocks,
                                              request_tokens),
                         "reserved_max_len": kv_memory // (bpt * max_len)})
    return sizes, fits


def count_paged(bm, num_blocks: int, request_tokens: int) -> int:
    """Allocate requests with the runtime's BlockManager until the pool is full."""
    if num_blocks == 0:
        return 0
    n = 0
    while bm.allocate_slots(n, request_tokens, write_from=0) is not None:
        n += 1
    return n


def make_llm(path, args, budget):
    from kvconvert.runtime import LLM

    bpt = kv_bytes_per_token(kv_shape(read_config(path)), args.kv_dtype)  # = the runtime's (tests/test_kv_bytes.py)
    max_tokens = max(args.batches) * (max(args.contexts) + args.decode_tokens + 1)
    kv_memory = int(min(max_tokens * bpt * 1.05 + (1 << 20), budget / 4))
    return LLM(path, kv_dtype=args.kv_dtype, kv_scales="dynamic", kv_memory=kv_memory,
               max_num_seqs=max(args.batches), max_num_batched_tokens=4096)


def runtime_row(name, llm, batch, context, args) -> dict:
    block_size, bpt = llm.config.block_size, llm.kv_bytes_per_token
    need = batch * -(-(context + args.decode_tokens + 1) // block_size) * block_size * bpt
    skipped = f"KV needs {need / 2**30:.1f} GiB" if need > llm.num_blocks * block_size * bpt else None
    return decode_row(name, "kvconvert-runtime", args.kv_dtype, batch, context, skipped, lambda: runtime_decode(
        llm, prompts_for(batch, context, llm.model.vocab_size, batch * context), args.decode_tokens))


def transformers_row(model, batch, context, args, budget) -> dict:
    config = model.config.to_dict()
    # weights-free estimate: the fp32 DynamicCache twice over (torch.cat copies)
    need = 2 * kv_bytes_per_token(kv_shape(config), "fp32") * batch * (context + args.decode_tokens)
    skipped = f"needs ~{need / 2**30:.0f} GiB" if need > budget else None
    return decode_row("source", "transformers", "fp32", batch, context, skipped, lambda: transformers_decode(
        model, prompts_for(batch, context, config["vocab_size"], batch * context), args.decode_tokens))


def decode_row(model: str, engine: str, kv_dtype: str, batch: int, context: int, skipped: str | None,
               tokens_per_s) -> dict:
    """One decode configuration: why it was skipped, or the rate tokens_per_s() measures."""
    row = {"model": model, "engine": engine, "batch": batch, "context": context, "kv_dtype": kv_dtype}
    if skipped:
        row["skipped"] = skipped
    else:
        row["tokens_per_s"] = round(tokens_per_s(), 3)
    print(json.dumps(row), file=sys.stderr)
    return row


# ---------------------------------------------------------------------------------------- report
def markdown(report: dict) -> str:
    lines = ["### Decode throughput (tokens/s, CPU)", "",
             "| model | engine | batch | context | tokens/s | vs transformers |", "|---|---|---:|---:|---:|---:|"]
    hf = {(r["batch"], r["context"]): r.get("tokens_per_s") for r in report["decode"] if r["engine"] == "transformers"}
    for r in report["decode"]:
        tps = r.get("tokens_per_s")
        ref = hf.get((r["batch"], r["context"]))
        ratio = f"{tps / ref:.2f}x" if tps and ref and r["engine"] != "transformers" else ""
        shown = f"{tps:.1f}" if tps else f"skipped ({r.get('skipped')})"
        lines.append(f"| {r['model']} | {r['engine']} | {r['batch']} | {r['context']} | {shown} | {ratio} |")
    lines += ["", "### KV cache size", "", "| model | kv dtype | bytes/token | vs source bf16 |", "|---|---|---:|---:|"]
    for r in report["kv_bytes_per_token"]:
        lines.append(f"| {r['model']} | {r['kv_dtype']} | {r['bytes_per_token']} | {r['fraction_of_source_bf16']:.3f} |")
    first = report["concurrency"][0] if report["concurrency"] else {"kv_memory_bytes": 0, "request_tokens": 0}
    title = f"### Concurrent {first['request_tokens']}-token requests in {first['kv_memory_bytes'] / 2**30:g} GiB of KV"
    lines += ["", title, "",
              "| model | kv dtype | paged | reserving max_model_len |", "|---|---|---:|---:|"]
    for r in report["concurrency"]:
        lines.append(f"| {r['model']} | {r['kv_dtype']} | {r['paged']} | {r['reserved_max_len']} "
                     f"(max_model_len {r['max_model_len']}) |")
    return "\n".join(lines)


def current_rows(report: dict, info: dict | None = None, cmd: str | None = None) -> dict:
    """Each measured decode configuration, with its speed against transformers at the same batch and context,
    for docs/BENCHMARKS.md's runtime table."""
    hf = {(r["batch"], r["context"]): r.get("tokens_per_s") for r in report["decode"] if r["engine"] == "transformers"}
    rows = []
    for r in report["decode"]:
        if not r.get("tokens_per_s"):
            continue
        ref = hf.get((r["batch"], r["context"])) if r["engine"] != "transformers" else None
        ratio = f" ({r['tokens_per_s'] / ref:.2f}x transformers)" if ref else ""
        rows.append((f"{r['model']} decode on {r['engine']} ({r['kv_dtype']} KV), batch {r['batch']} x {r['context']} "
                     f"context, {report['machine']['torch_threads']} threads: tokens/s", f"{r['tokens_per_s']:.1f}{ratio}"))
    return {"runtime": bench_rows(rows, info, cmd)}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvconvert.sources import resolve_source

    source = resolve_source(args.source)
    models = {"source": source}
    if args.mla:
        models["mla"] = Path(args.mla)
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "ram_gib": round(ram_bytes() / 2**30, 1), "torch": torch.__version__},
        "settings": {"batches": args.batches, "contexts": args.contexts, "decode_tokens": args.decode_tokens,
                     "runtime_kv_dtype": args.kv_dtype, "compute_dtype": "fp32", "quick": args.quick},
        "decode": [],
    }
    budget = 0.7 * ram_bytes()
    engines = {name: make_llm(path, args, budget) for name, path in models.items()}
    hf = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    # interleaved per configuration, so a busy machine slows every engine alike
    for batch in args.batches:
        for context in args.contexts:
            for name, llm in engines.items():
                report["decode"].append(runtime_row(name, llm, batch, context, args))
            if hf is not None:
                report["decode"].append(transformers_row(hf, batch, context, args, budget))
    report["kv_bytes_per_token"], report["concurrency"] = kv_table(models, args.kv_memory, args.request_tokens)
    report["bench_rows"] = current_rows(report)
    write_json(args.out, report)
    publish_rows(report, args.out)
    print(markdown(report))
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
