#!/usr/bin/env python
"""GPU benchmark of kvconvert's Triton decode kernels: achieved KV bandwidth vs the device's peak.

For each cache mode and context length (1K..32K tokens) it times one decode step of the paged MLA
kernel (DeepSeek-V3 shape: kv_lora_rank 512, rope 64, 16 heads = one TP-8 shard) and of the paged GQA
kernel (Llama-3-8B shape: 32 query / 8 KV heads, head_dim 128), and reports
``bandwidth = bytes of KV read / time`` against the HBM peak of the device (spec sheet) and a
measured device-to-device copy. FlashMLA (bf16 MLA) and FlashInfer (bf16/fp8 GQA, bf16 MLA) are
timed on the same inputs when importable. Before timing, every mode is checked against the PyTorch
reference on the GPU (bf16 dot operands: output rel. error < 1e-2; fp32 operands: < 1e-4).

Writes docs/bench_kernels.json and docs/bench_kernels.md (a markdown section). Without a CUDA GPU
(or without Triton) it prints that the benchmark was not run and exits 0; the kernels' correctness
on CPU is covered by tests/kernels in the Triton interpreter.

    python scripts/bench_kernels.py            # the short run (default): MLA + GQA, 8K and 32K, tuned configs
    python scripts/bench_kernels.py --tune     # the tuning sweep: 11 configs x split counts per mode (~10 min)
    python scripts/bench_kernels.py --quick    # the sweep on a 5-config grid, contexts 1K and 8K
    python scripts/bench_kernels.py --cpu-smoke  # plumbing check in the Triton interpreter (numbers meaningless)

The short run times every cache mode with the launch configs the tuning runs found (TUNED,
docs/BENCHMARKS.md "Kernels": MLA tuned at 32K, GQA at 8K), so a short lease reproduces the tuned
numbers. Its size, counted by ``short_plan``: 2 contexts x (15 MLA rows: bf16; fp8 with bf16 / fp16 / fp8 dots;
fp8_tile and nvfp4 with bf16 / fp16 dots; the read-path candidates: fp8 and nvfp4 on word planes with bf16 / fp16
dots, fp8 planes at 49 splits, the second latent load for fp8 and nvfp4; + FlashMLA and FlashInfer on bf16;
and 8 GQA rows: bf16; fp8 with bf16 / fp16 / fp8 dots; nvfp4 with bf16 / fp16 dots and on word planes with
bf16 / fp16 dots; + FlashInfer on bf16 and fp8) = 54 timings, each a CUDA graph of about 40 ms of back-to-back steps replayed 10 times (~0.5 s with
the capture), ~27 s; 22 kernel compiles (2-4 s each on 2 loaded CPU cores here: one per launch config, shared
by both contexts and the checks, num_splits not specialized), ~65 s; 20 cache fills and 23 checks, ~20 s:
**about 2 min on an H100** for kvconvert's rows, written first; the peers come last, their first calls
JIT-compiling with nvcc (FlashInfer: about a minute per kernel, not measured here). Each row also reports
its speed relative to the bf16 cache's at the same context and its bandwidth as a fraction of the measured
device-to-device copy (the bf16 target: >= 85% of it).
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import sys
import time

import torch
from bench_common import DOCS, bench_rows, parser, publish_rows, run_info, write_json, write_text

from kvconvert.kernels._launch import FP8_DOT_MIN_BLOCK_N, e4m3_query_rows
from kvconvert.kernels.cache_layout import GQA_MODES, MLA_MODES, GQACacheLayer, MLACacheLayer

DEVICE = "cuda"  # "cpu" only for --cpu-smoke (Triton interpreter)

# HBM bandwidth from vendor spec sheets, bytes/s; first substring match of the device name wins
PEAK_BANDWIDTH = [
    ("GH200", 4.0e12),
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),
    ("H800", 3.35e12),
    ("B200", 8.0e12),
    ("B100", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
]

# (block_h, block_n, num_warps, num_stages) candidates tuned per mode at the tuning context. block_h 16
# runs the dots on mma.sync; 64 is the tile Hopper's wgmma takes (the 16-head MLA shard and a GQA group
# of 4 pad the rest), the only one where fp8 dots run on fp8 matrix units (tests/kernels/compile_kernels.py)
TUNE_GRID = [(16, 16, 4, 2), (16, 16, 4, 3), (16, 32, 4, 2), (16, 32, 8, 2), (16, 32, 8, 3), (16, 64, 8, 2),
             (16, 64, 8, 3), (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (64, 64, 4, 3)]
FULL_CONTEXTS, QUICK_CONTEXTS, SHORT_CONTEXTS = "1024,2048,4096,8192,16384,32768", "1024,8192", "8192,32768"
QUICK_GRID = [(16, 32, 8, 2), (16, 64, 8, 2), (16, 64, 8, 3), (64, 64, 8, 2), (64, 64, 4, 3)]


# The short run's launch configs, from the tuning runs on an H100 (docs/BENCHMARKS.md "Kernels"):
# MLA: run B, tuned at 32K over the full grid x 4 split counts: (block_h 16, block_n 32, 4 warps, 2 stages) won
# for every mode, fp8 dots included, at the default split count (33 at 32K: 264 programs); GQA: run A, tuned
# at 8K (bench_kernels.json's gqa_tuning), the split count the default heuristic's. Keyed (kernel, mode, dot);
# a dot variant without its own entry runs with its mode's (as the sweep times the fp16-dot rows).
_MLA_TUNED = {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2}
TUNED = {
    **{("mla", mode, None): _MLA_TUNED for mode in MLA_MODES},
    ("mla", "fp8", "fp8"): _MLA_TUNED,
    ("gqa", "none", None): {"block_h": 16, "block_n": 32, "num_warps": 8, "num_stages": 2},
    ("gqa", "fp8", None): {"block_h": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
    ("gqa", "nvfp4", None): {"block_h": 16, "block_n": 64, "num_warps": 8, "num_stages": 2},
    ("gqa", "fp8", "fp8"): {"block_h": 16, "block_n": 64, "num_warps": 8, "num_stages": 3},
}
# Rows the short run adds beside the tuned ones (impl, mode, dot, launcher options that replace the tuned
# config's): the read-path candidates that one GPU run decides (docs/BENCHMARKS.md "Kernels").
# word_planes: the fp8 latent read as 16-bit words on even/odd byte planes (no byte-wise transpose of the P@V
# operand, no spill, 168 registers instead of 255 at the tuned config), the NVFP4 latent on four nibble planes
# (no spill, 2.5x fewer conversions), each with the default (bf16) and fp16 dots.
# latent_loads 2 at block_n 64 / 8 warps / 3 stages: the config where the compile analysis found both
# latent loads pipelined (cp.async) and spill-free.
_TWO_LOADS = {"latent_loads": 2, "block_n": 64, "num_warps": 8, "num_stages": 3}
CANDIDATES = {
    "mla": [*((impl, mode, dot, {"word_planes": True}) for mode in ("fp8", "nvfp4")
              for impl, dot in (("triton-planes", None), ("triton-planes-fp16dot", "fp16"))),
            # at 168 registers 3 CTAs of 4 warps fit an SM, where the byte path's 255 allowed 2: 49 splits x batch
            # 8 = 392 CTAs fill H100's 132 x 3 slots, where the default 33 (264 CTAs) fills 2 of 3
            ("triton-planes-49splits", "fp8", None, {"word_planes": True, "num_splits": 49}),
            ("triton-2loads", "fp8", None, _TWO_LOADS), ("triton-2loads", "nvfp4", None, _TWO_LOADS)],
    # GQA: NVFP4 K/V on nibble planes (byte-wise reads 20 -> 2, conversions 227 -> 140, but more registers);
    # fp8's tuned 64-row wgmma tile reads no bytes one by one, so its planes are not timed
    "gqa": [("triton-planes", "nvfp4", None, {"word_planes": True}),
            ("triton-planes-fp16dot", "nvfp4", "fp16", {"word_planes": True})],
}


def tuned_config(kernel: str, mode: str, dot: str | None) -> dict:
    """The short run's launch config of (kernel, mode, dot): TUNED's entry, else its mode's."""
    return dict(TUNED.get((kernel, mode, dot)) or TUNED[(kernel, mode, None)])


def short_plan(kernel: str) -> list[tuple[str, str, str | None, dict]]:
    """The short run's kvconvert rows of one kernel, per context: (impl, mode, dot, launcher options).
    Every mode with the default (bf16) dots, the quantized ones also with fp16 dots, fp8 also with fp8 dots,
    then CANDIDATES; the peers' rows come on top (peer_rows)."""
    modes = MLA_MODES if kernel == "mla" else GQA_MODES
    plan = [("triton", mode, None, tuned_config(kernel, mode, None)) for mode in modes]
    plan += [("triton-fp16dot", mode, "fp16", tuned_config(kernel, mode, "fp16")) for mode in modes if mode != "none"]
    plan += [("triton-fp8dot", "fp8", "fp8", tuned_config(kernel, "fp8", "fp8"))]
    plan += [(impl, mode, dot, {**tuned_config(kernel, mode, dot), **opts})
             for impl, mode, dot, opts in CANDIDATES[kernel]]
    return plan


def parse_args(argv):
    p = parser(__doc__)
    p.add_argument("--contexts", default=None,
                   help="comma-separated context lengths (default 8192,32768; --tune: 1024..32768; --quick: 1024,8192)")
    p.add_argument("--batch", type=int, default=8, help="sequences per decode step")
    p.add_argument("--mla-heads", type=int, default=16, help="query heads per MLA shard (DeepSeek-V3 TP-8: 16)")
    p.add_argument("--block-size", type=int, default=64, help="paged block size (FlashMLA needs 64)")
    p.add_argument("--tune-context", type=int, default=8192, help="context at which the launch config is tuned")
    p.add_argument("--tune", action="store_true",
                   help="the tuning sweep (11 configs x split counts per mode at --tune-context) instead of the short run")
    p.add_argument("--quick", action="store_true", help="the sweep on a 5-config grid; contexts 1K and 8K unless --contexts")
    p.add_argument("--skip-gqa", action="store_true")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the whole script on CPU in the Triton interpreter at toy sizes (checks the plumbing only)")
    p.add_argument("--json", default=None, help="default: docs/bench_kernels.json (--cpu-smoke: /tmp/...smoke.json)")
    p.add_argument("--md", default=None, help="default: docs/bench_kernels.md (--cpu-smoke: /tmp/...smoke.md)")
    return p.parse_args(argv)


def peak_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in PEAK_BANDWIDTH if key in name), None)


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


def random_paging(batch, context, block_size, device, seed=0):
    """Block tables with random distinct physical blocks; every sequence ``context`` tokens long."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = math.ceil(context / block_size)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, generator=gen).reshape(batch, per_seq).int().to(device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return tables, lens, num_blocks


def fill_cache(cache, row_dims, chunk=65536):
    """Quantize random rows into every slot of a cache layer (through the real formats)."""
    total = cache.num_blocks * cache.block_size
    for start in range(0, total, chunk):
        n = min(chunk, total - start)
        rows = [torch.randn(n, *dims, device=cache.device) for dims in row_dims]
        for dst, r in cache.quantize_rows(*rows):
            dst.view(total, *dst.shape[2:])[start : start + n].copy_(r)


def mla_case(mode, batch, context, block_size, heads=16, rank=512, rope=64, seed=0):
    """(cache, (q_nope, q_rope), tables, lens, softmax scale); default: a DeepSeek-V3 TP-8 shard."""
    tables, lens, num_blocks = random_paging(batch, context, block_size, DEVICE, seed)
    cache = MLACacheLayer.allocate(mode, num_blocks, block_size, rank, rope, dtype=torch.bfloat16, device=DEVICE,
                                   kv_scale=4.5 / 448)
    fill_cache(cache, [(rank,), (rope,)])
    q_nope = torch.randn(batch, heads, rank, device=DEVICE, dtype=torch.bfloat16)
    q_rope = torch.randn(batch, heads, rope, device=DEVICE, dtype=torch.bfloat16)
    return cache, (q_nope, q_rope), tables, lens, (rank + rope) ** -0.5


def gqa_case(mode, batch, context, block_size, q_heads=32, kv_heads=8, head_dim=128, seed=0):
    """(cache, (q,), tables, lens, softmax scale); default: Llama-3-8B's attention."""
    tables, lens, num_blocks = random_paging(batch, context, block_size, DEVICE, seed)
    cache = GQACacheLayer.allocate(mode, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16,
                                   device=DEVICE, k_scale=4.5 / 448, v_scale=4.5 / 448)
    fill_cache(cache, [(kv_heads, head_dim), (kv_heads, head_dim)])
    q = torch.randn(batch, q_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    return cache, (q,), tables, lens, head_dim**-0.5


def decode_fn(kernel: str):
    """paged_mla_decode or paged_gqa_decode ("mla" / "gqa"): (*queries, cache, tables, lens, scale, backend=...,
    **kernel_options); backend="torch" runs the PyTorch reference."""
    from kvconvert.kernels import attention

    return getattr(attention, f"paged_{kernel}_decode")


# ----------------------------------------------------------------------------------------------
# correctness on the GPU
# ----------------------------------------------------------------------------------------------


def check_dots() -> list[tuple[str, float]]:
    """(dot precision, max rel. error) pairs to check; bf16 dots are wrong in the interpreter."""
    low = [("fp16", 1e-2)] if DEVICE == "cpu" else [("bf16", 1e-2), ("fp16", 1e-2)]
    return low + [("fp32", 1e-4)]


def check_kernels():
    """Kernel vs reference on small ragged cases, per mode, with bf16 and fp32 dot operands; fp8 caches
    also with fp8 dots, against the reference given the same e4m3 queries (tolerance 3e-2: the
    probabilities' e4m3 rounding, as in tests/kernels)."""
    cases = [("mla", mode, f"R{rank}+{rope} H{heads}", [300, 1, 129],
              mla_case(mode, 3, 300, 64, heads=heads, rank=rank, rope=rope, seed=1))
             for mode in MLA_MODES for rank, rope, heads in ((512, 64, 16), (160, 32, 9))]
    cases += [("gqa", mode, f"{hq}q/{hk}kv D{d}", [300, 0, 77],
               gqa_case(mode, 3, 300, 16, q_heads=hq, kv_heads=hk, head_dim=d, seed=2))
              for mode in GQA_MODES for hq, hk, d in ((32, 8, 128), (9, 3, 64))]
    results = []
    for kernel, mode, shape, lens, (cache, queries, tables, _, scale) in cases:
        decode = decode_fn(kernel)
        inputs = (*(q.float() for q in queries), cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE))
        ref, ref_lse = decode(*inputs, scale, backend="torch")
        for dot, tol in check_dots() + ([("fp8", 3e-2)] if mode == "fp8" else []):
            if dot == "fp8":
                fp8_inputs = (*(e4m3_query_rows(q.float()) for q in queries), *inputs[len(queries):])
                ref, ref_lse = decode(*fp8_inputs, scale, backend="torch")
            out, lse = decode(*inputs, scale, dot=dot, **({"block_n": FP8_DOT_MIN_BLOCK_N} if dot == "fp8" else {}))
            err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))
            lse_err = {"lse_max_abs_err": float((lse - ref_lse).abs().max())} if kernel == "mla" else {}
            results.append({"kernel": kernel, "mode": mode, "shape": shape, "dot": dot, "rel_err": err, **lse_err,
                            "ok": err < tol})
    return results


def check_short(args, plans) -> list[dict]:
    """The short run's checks: every row of ``plans`` ({kernel: short_plan(kernel)}) on the benchmark's own
    shapes and launch config (so its compile is the timed one's), on three ragged sequences (1000, 1 and
    129 tokens) in tables 16 blocks wide, against the float64 reference: bf16 / fp16 dots rel. error < 1e-2,
    fp8 dots < 3e-2 against the reference given the same e4m3 queries (tests/kernels states the same)."""
    results = []
    for kernel, plan in plans.items():
        decode = decode_fn(kernel)
        for impl, mode, dot, cfg in plan:
            cache, queries, tables, _, scale = make_case(kernel, mode, args, 3, 16 * args.block_size, seed=1)
            lens = torch.tensor([16 * args.block_size - 24, 1, 129], dtype=torch.int32, device=DEVICE)
            qs = tuple(e4m3_query_rows(q) for q in queries) if dot == "fp8" else queries
            ref, _ = decode(*(q.float() for q in qs), cache, tables, lens, scale, backend="torch")
            out, _ = decode(*queries, cache, tables, lens, scale, dot=dot or check_dots()[0][0], **cfg)
            err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))
            results.append({"kernel": kernel, "impl": impl, "mode": mode, "shape": "bench", "dot": dot or "default",
                            "config": cfg, "rel_err": err, "ok": err < (3e-2 if dot == "fp8" else 1e-2)})
    return results


def make_case(kernel, mode, args, batch, context, seed=0):
    """The benchmark's case of a kernel: MLA on args.mla_heads heads, GQA on Llama-3-8B's shape."""
    if kernel == "mla":
        return mla_case(mode, batch, context, args.block_size, heads=args.mla_heads, seed=seed)
    return gqa_case(mode, batch, context, args.block_size, seed=seed)


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def time_ms(fn, graph: bool = True) -> float:
    """Device time of one call (median), launch gaps removed: the call is captured in a CUDA graph
    and its replays are timed with events. A decode step in a serving engine runs inside a graph
    too (vLLM, SGLang), so this is the number that matters. graph=False: wall time per call launched
    from Python (median of event-timed calls), which adds the launch overhead."""
    if DEVICE == "cpu":  # --cpu-smoke: one timed call, no CUDA events
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    if not graph:
        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    fn()  # compile outside the capture
    return float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))


def dequant_first_ms(cache) -> float:
    """The unfused alternative's extra step: dequantize the whole cache to bf16 with PyTorch ops
    (kvconvert.number_formats) before a bf16 kernel reads it. Timed eagerly (its lookup tables are
    built on the host, which a graph capture refuses); its kernels are large, so launch cost is small."""
    return time_ms(lambda: [t.to(torch.bfloat16) for t in cache.dequantize()], graph=False)


def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth (read + write bytes / time) on 1 GiB."""
    if DEVICE == "cpu":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * (1 << 30) / (ms * 1e-3)


def tune(run_with, grid, splits_candidates, variants=({},)):
    """Best (block_h, block_n, warps, stages, splits, variant options) by time; compile failures are
    recorded and skipped. variants: extra launcher options tried on every grid point (e.g. latent_loads)."""
    tried, best = [], None
    for variant, (block_h, block_n, warps, stages) in itertools.product(variants, grid):
        for splits in splits_candidates:
            cfg = {"block_h": block_h, "block_n": block_n, "num_warps": warps, "num_stages": stages,
                   "num_splits": splits, **variant}
            try:
                ms = time_ms(lambda: run_with(cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped, not fatal
                tried.append({**cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                break
            tried.append({**cfg, "ms": ms})
            if best is None or ms < best[1]:
                best = (cfg, ms)
    return (best[0] if best else None), tried


def measure_step(step, mode, dot, cache, batch, context, peak, cfg, plain_ms) -> list[dict]:
    """Rows for one (mode, context): the decode ``step(dot=...)`` timed from a CUDA graph and eagerly,
    the dequantize-first alternative (quantized modes, next to the plain time at this context), and
    the same step with fp16 dot operands (exact for quantized values). ``plain_ms`` collects the
    plain mode's times; MODES lists "none" first so they exist when the quantized modes run.
    dot="fp8" (an fp8 cache's own variant, tuned apart): one row, impl "triton-fp8dot"."""
    call = lambda: step(dot=dot)  # noqa: E731
    ms = time_ms(call)
    if dot == "fp8":
        return [result_row("triton-fp8dot", mode, cache, batch, context, ms, peak, cfg, eager=time_ms(call, graph=False))]
    rows = [result_row("triton", mode, cache, batch, context, ms, peak, cfg, eager=time_ms(call, graph=False))]
    if mode == "none":
        plain_ms[context] = ms
        return rows
    if context in plain_ms:
        rows[0]["unfused_us"] = (dequant_first_ms(cache) + plain_ms[context]) * 1e3
    rows.append(result_row("triton-fp16dot", mode, cache, batch, context, time_ms(lambda: step(dot="fp16")), peak, cfg))
    return rows


def bench_kernel(kernel: str, args, contexts, grid, peak):
    """Rows and tuning trials of one kernel: per mode, the launch config tuned at args.tune_context, then
    every context timed with it (MLA: num_splits also tuned, as a ratio to the default heuristic's)."""
    from kvconvert.kernels._launch import default_num_splits

    decode = decode_fn(kernel)
    if kernel == "mla":
        modes, baselines = MLA_MODES, mla_baselines
        make_case = lambda mode, context: mla_case(mode, args.batch, context, args.block_size,  # noqa: E731
                                                   heads=args.mla_heads)
        default_splits = lambda context: default_num_splits(args.batch, math.ceil(args.mla_heads / 16),  # noqa: E731
                                                            context, 16)
    else:
        modes, baselines = GQA_MODES, gqa_baselines
        make_case = lambda mode, context: gqa_case(mode, args.batch, context, args.block_size)  # noqa: E731
        default_splits = None
    rows, tuning, plain_ms = [], {}, {}
    # each mode with the default dots, then the fp8 cache with fp8 dots, tuned apart (its own tiles)
    for mode, dot in [(mode, None) for mode in modes] + [("fp8", "fp8")]:
        cache, queries, tables, lens, scale = make_case(mode, args.tune_context)
        base = default_splits and default_splits(args.tune_context)
        splits = sorted({max(1, base // 2), base, base * 2, base * 4}) if base else [None]
        mode_grid = [g for g in grid if g[1] >= FP8_DOT_MIN_BLOCK_N] if dot == "fp8" else grid
        # a quantized latent also tried with a second, transposed load for QK^T (both loads then compile
        # to cp.async; tests/kernels/test_kernel_compile.py)
        variants = ({}, {"latent_loads": 2}) if kernel == "mla" and mode != "none" else ({},)
        best, tried = tune(lambda cfg: decode(*queries, cache, tables, lens, scale, dot=dot, **cfg), mode_grid, splits,
                           variants)
        tuning[f"{mode}, {dot} dot" if dot else mode] = {"best": best, "tried": tried}
        if best is None:
            continue
        for context in contexts:
            cache, queries, tables, lens, scale = make_case(mode, context)
            cfg = {**best, "num_splits": max(1, round(default_splits(context) * best["num_splits"] / base))} \
                if base else best
            step = lambda dot: decode(*queries, cache, tables, lens, scale, dot=dot, **cfg)  # noqa: E731
            rows += measure_step(step, mode, dot, cache, args.batch, context, peak, cfg, plain_ms)
            if dot is None:
                rows += baselines(mode, cache, queries, tables, lens, scale, args.batch, context, peak)
            torch.cuda.empty_cache()
    return rows, tuning


def bench_short(kernel: str, args, contexts, peak) -> list[dict]:
    """The short run's kvconvert rows of one kernel: short_plan's rows at every context, each timed from a
    CUDA graph with its fixed launch config (no tuning). The peers' rows come after (bench_peers)."""
    decode, rows = decode_fn(kernel), []
    plan = short_plan(kernel)
    for context in contexts:
        for mode in dict.fromkeys(m for _, m, _, _ in plan):  # one cache per mode and context
            cache, queries, tables, lens, scale = make_case(kernel, mode, args, args.batch, context)
            for impl, _, dot, cfg in (row for row in plan if row[1] == mode):
                try:
                    ms = time_ms(lambda: decode(*queries, cache, tables, lens, scale, dot=dot, **cfg))  # noqa: B023
                    rows.append(result_row(impl, mode, cache, args.batch, context, ms, peak, cfg))
                except Exception as e:  # noqa: BLE001 - a row that fails is recorded, the run goes on
                    rows.append(result_row(impl, mode, cache, args.batch, context, None, peak, cfg,
                                           error=f"{type(e).__name__}: {str(e)[:200]}"))
                print(f"{kernel} {context} {impl} {mode}: {rows[-1]['time_us'] or rows[-1]['error']}", flush=True)
            del cache
            torch.cuda.empty_cache() if DEVICE == "cuda" else None
    return rows


def add_ratios(rows: list[dict], copy_GBps: float) -> None:
    """Each row's speed relative to the bf16 cache's kvconvert row at its context (bf16 time / its time) and
    its KV bandwidth as a fraction of the measured device-to-device copy."""
    bf16 = {r["context"]: r["time_us"] for r in rows if r["impl"] == "triton" and r["mode"] == "none" and r["time_us"]}
    for r in rows:
        ok = r["time_us"] and r["context"] in bf16
        r["speed_vs_bf16"] = bf16[r["context"]] / r["time_us"] if ok else None
        r["frac_of_copy"] = r["kv_GBps"] / copy_GBps if (r["kv_GBps"] and copy_GBps == copy_GBps) else None


def result_row(impl, mode, cache, batch, context, ms, peak, cfg=None, error=None, eager=None):
    kv_bytes = batch * context * cache.bytes_per_token
    bw = kv_bytes / (ms * 1e-3) if ms else None
    return {
        "impl": impl, "mode": mode, "batch": batch, "context": context, "bytes_per_token": cache.bytes_per_token,
        "time_us": ms * 1e3 if ms else None, "kv_GBps": bw / 1e9 if bw else None,
        "frac_of_peak": bw / peak if (bw and peak) else None, "config": cfg, "error": error,
        "eager_us": eager * 1e3 if eager else None, "unfused_us": None,
    }


def baseline(impl, module, mode, cache, batch, context, peak, timed, report_missing=False, ours=None) -> list[dict]:
    """A third-party kernel's row, best effort. ``timed(lib)`` -> (ms, its output); the row records its error
    when that fails, and, given ``ours`` (kvconvert's output on the same inputs, itself checked against the
    float64 reference), ``peer_rel_err``: ||peer - ours|| / ||ours||, which says the peer computed the same
    attention. When `module` does not import: a row saying why (report_missing; once per kernel) or none."""
    try:
        lib = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - ImportError, or a library that fails at import (CUDA/torch mismatch)
        why = f"not importable: {type(e).__name__}: {str(e)[:180]}"
        return [result_row(impl, mode, cache, batch, context, None, peak, error=why)] if report_missing else []
    try:
        ms, out = timed(lib)
    except Exception as e:  # noqa: BLE001
        return [result_row(impl, mode, cache, batch, context, None, peak, error=f"{type(e).__name__}: {str(e)[:200]}")]
    row = result_row(impl, mode, cache, batch, context, ms, peak, {"version": getattr(lib, "__version__", None)})
    if ours is not None:
        out = out.reshape(ours.shape).float()
        row["peer_rel_err"] = float((out - ours.float()).norm() / ours.float().norm().clamp(min=1e-30))
    return [row]


# FlashInfer's documented API as of flashinfer-python 0.6.4 (the wheel `gpu_session.sh prepare` downloads):
# BatchMLAPagedAttentionWrapper(float_workspace_buffer, use_cuda_graph=False, ...), .plan(qo_indptr, kv_indptr,
# kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
# kv_data_type), .run(q_nope, q_pe, ckv_cache [pages, page_size, R], kpe_cache [pages, page_size, P]);
# BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, use_cuda_graph, use_tensor_cores,
# paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer), .plan(indptr, indices,
# last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type=, kv_data_type=, sm_scale=),
# .run(q, (k_cache, v_cache), k_scale=, v_scale=). Both JIT-compile their kernels with nvcc on first use.
FLASHINFER_WORKSPACE = 128 << 20


def mla_baselines(mode, cache, queries, tables, lens, scale, batch, context, peak, report_missing=False, ours=None):
    """FlashMLA and FlashInfer on the same bf16 cache (mode "none" only)."""
    if mode != "none":
        return []
    (qn, qr), r, heads = queries, cache.kv_lora_rank, queries[0].shape[1]

    def flashmla(flash_mla):
        q = torch.cat([qn, qr], -1).unsqueeze(1)  # [B, 1, H, 576]
        kv = cache.data.unsqueeze(2)  # [nb, 64, 1, 576]
        if hasattr(flash_mla, "get_mla_decoding_metadata"):
            # sgl-flash-mla 1.0 (the wheel prepare downloads): dense bf16 decode is its "legacy" (SM90) half, and
            # the scheduler metadata, an empty FlashMLASchedMeta, is filled by the first call (time_ms makes
            # that call before the graph capture)
            meta, _ = flash_mla.get_mla_metadata()
            options = {"use_legacy": True}
        else:  # FlashMLA's original interface
            meta, splits = flash_mla.get_mla_metadata(lens, heads, 1)
            options = {"num_splits": splits}
        run = lambda: flash_mla.flash_mla_with_kvcache(q, kv, tables, lens, r, meta, softmax_scale=scale,  # noqa: E731
                                                       causal=False, **options)[0]
        return time_ms(run), run()

    def flashinfer(flashinfer):
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=DEVICE))
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
        kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * tables.shape[1]
        wrapper.plan(qo_indptr, kv_indptr, tables.reshape(-1).contiguous(), lens, heads, r, cache.rope_dim,
                     cache.block_size, False, scale, qn.dtype, cache.data.dtype)
        # FlashInfer keeps the latent and the RoPE key as two paged tensors: the same bytes, split
        ckv, kpe = cache.data[..., :r].contiguous(), cache.data[..., r:].contiguous()
        run = lambda: wrapper.run(qn, qr, ckv, kpe)  # noqa: E731
        return time_ms(run), run()

    return (baseline("flashmla", "flash_mla", mode, cache, batch, context, peak, flashmla, report_missing, ours)
            + baseline("flashinfer", "flashinfer", mode, cache, batch, context, peak, flashinfer, report_missing, ours))


def gqa_baselines(mode, cache, queries, tables, lens, scale, batch, context, peak, report_missing=False, ours=None):
    """FlashInfer batch decode on the same NHD paged cache (bf16, or fp8 with the same per-tensor scales),
    captured in a CUDA graph as a serving engine runs it (use_cuda_graph with fixed index buffers) and on
    tensor cores (use_tensor_cores: what vLLM / SGLang pick for a GQA group of 4 or more)."""
    if mode not in ("none", "fp8"):
        return []
    (q,) = queries

    def flashinfer(flashinfer):
        per_seq = tables.shape[1]
        indptr = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * per_seq
        indices = tables.reshape(-1).contiguous()
        last = lens - (per_seq - 1) * cache.block_size  # every sequence fills its pages but the last
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=DEVICE), "NHD", use_cuda_graph=True,
            use_tensor_cores=q.shape[1] // cache.kv_heads >= 4, paged_kv_indptr_buffer=torch.empty_like(indptr),
            paged_kv_indices_buffer=torch.empty_like(indices), paged_kv_last_page_len_buffer=torch.empty_like(last))
        wrapper.plan(indptr, indices, last, q.shape[1], cache.kv_heads, cache.head_dim, cache.block_size,
                     q_data_type=q.dtype, kv_data_type=cache.k.dtype, sm_scale=scale)
        scales = {"k_scale": float(cache.k_scale[0]), "v_scale": float(cache.v_scale[0])} if mode == "fp8" else {}
        run = lambda: wrapper.run(q, (cache.k, cache.v), **scales)  # noqa: E731
        return time_ms(run), run()

    return baseline("flashinfer", "flashinfer", mode, cache, batch, context, peak, flashinfer, report_missing, ours)


def bench_peers(kernel: str, args, contexts, peak) -> list[dict]:
    """The peers' rows (FlashInfer, FlashMLA) on the short run's caches and queries, after every kvconvert row
    is written: their first call JIT-compiles with nvcc, which a step timeout may cut short. Each is compared
    with kvconvert's output on the same inputs (peer_rel_err)."""
    decode, rows = decode_fn(kernel), []
    baselines = mla_baselines if kernel == "mla" else gqa_baselines
    for context in contexts:
        for mode in ("none",) if kernel == "mla" else ("none", "fp8"):  # the caches the peers read
            cache, queries, tables, lens, scale = make_case(kernel, mode, args, args.batch, context)
            ours, _ = decode(*queries, cache, tables, lens, scale, **tuned_config(kernel, mode, None))
            rows += baselines(mode, cache, queries, tables, lens, scale, args.batch, context, peak,
                              report_missing=context == contexts[0], ours=ours)
            del cache
            torch.cuda.empty_cache() if DEVICE == "cuda" else None
    return rows


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def markdown(report) -> str:
    peak, copy = report["peak_bandwidth_GBps"], report["copy_bandwidth_GBps"]
    lines = [
        f"## Kernel benchmark ({report['device']}, {report.get('run', 'sweep')} run)",
        "",
        "time: device time of one decode step (stage 1 + LSE merge) replayed from a CUDA graph, median; "
        "vs bf16: the bf16 cache's kvconvert time at that context / this row's (above 1 = faster); % of copy: "
        "KV bandwidth / the measured device-to-device copy's (target for bf16: >= 85%); eager: the same step "
        "launched from Python (sweep only); unfused: PyTorch dequantizes the whole cache to bf16, then the bf16 "
        "kernel runs (sweep only).",
        "",
        f"Decode step, batch {report['batch']}, block size {report['block_size']}; bandwidth = bytes of KV read / time. "
        f"Peak HBM (spec): {peak:.0f} GB/s; measured copy: {copy:.0f} GB/s."
        if peak else f"Measured copy bandwidth: {copy:.0f} GB/s (spec peak unknown for this device).",
        "",
        f"Checks vs PyTorch reference: {sum(c['ok'] for c in report['checks'])}/{len(report['checks'])} passed.",
    ]
    for kernel, title in (("mla", f"MLA (R 512 + rope 64, {report['mla_heads']} heads)"), ("gqa", "GQA (32 q / 8 kv heads, D 128)")):
        rows = report.get(kernel, [])
        if not rows:
            continue
        lines += ["", f"### {title}", "",
                  "| impl | mode | bytes/token | context | time (us) | vs bf16 | KV GB/s | % of copy | % of peak "
                  "| eager (us) | unfused (us) | config |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            first = f"| {r['impl']} | {r['mode']} | {r['bytes_per_token']} | {r['context']} |"
            if r["error"]:
                lines.append(f"{first} - | - | - | - | - | - | - | error: {r['error'][:80]} |")
                continue
            pct = lambda x: f"{100 * x:.0f}%" if x else "-"  # noqa: E731
            speed = f"{r['speed_vs_bf16']:.2f}x" if r.get("speed_vs_bf16") else "-"
            eager, unfused = (f"{r[key]:.1f}" if r.get(key) else "-" for key in ("eager_us", "unfused_us"))
            cfg_s = " ".join(f"{k}={v}" for k, v in (r["config"] or {}).items() if v is not None)
            if r.get("peer_rel_err") is not None:  # a peer's output vs kvconvert's on the same inputs
                cfg_s += f" rel. diff to kvconvert {r['peer_rel_err']:.1e}"
            lines.append(f"{first} {r['time_us']:.1f} | {speed} | {r['kv_GBps']:.0f} | {pct(r.get('frac_of_copy'))} | "
                         f"{pct(r['frac_of_peak'])} | {eager} | {unfused} | {cfg_s} |")
    return "\n".join(lines) + "\n"


def current_rows(report: dict, info: dict | None = None, cmd: str | None = None) -> dict:
    """Every kernel row at the run's longest context, for docs/BENCHMARKS.md's runtime table: the step's time,
    its speed against the bf16 cache's row and its KV bandwidth."""
    context = max(report["contexts"])
    titles = {"mla": f"MLA decode (R 512 + rope 64, {report['mla_heads']} heads)", "gqa": "GQA decode (32 q / 8 kv, D 128)"}
    rows = []
    for kernel, title in titles.items():
        found = [r for r in report.get(kernel, []) if r["context"] == context and r["time_us"] and not r["error"]]
        bf16 = next((r["time_us"] for r in found if r["impl"] == "triton" and r["mode"] == "none"), None)
        for r in found:
            speed = f", {bf16 / r['time_us']:.2f}x the bf16 cache" if bf16 else ""
            cache = "bf16" if r["mode"] == "none" else r["mode"]
            rows.append((f"{title}, {r['impl']} on a {cache} cache, batch {r['batch']} x {context} tokens, block "
                         f"{report['block_size']}: time per step (CUDA graph)",
                         f"{r['time_us']:.1f} us{speed}, KV {r['kv_GBps']:.0f} GB/s (copy {report['copy_bandwidth_GBps']:.0f})"))
    return {"runtime": bench_rows(rows, info, cmd)}


def main(argv=None) -> int:
    global DEVICE
    args = parse_args(argv)
    if args.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            # the kernels were decorated for compiling when this module imported kvconvert.kernels;
            # the interpreter has to be chosen before that import, so start again with it set
            argv = sys.argv[1:] if argv is None else argv
            os.execve(sys.executable, [sys.executable, __file__, *argv], {**os.environ, "TRITON_INTERPRET": "1"})
        DEVICE = "cpu"
        args.batch, args.mla_heads, args.block_size, args.tune_context = 2, 16, 16, 64
        args.contexts = "48" if (args.tune or args.quick) else "64"
    elif not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU visible, benchmark not run (on CPU the kernels are verified by "
              "tests/kernels in the Triton interpreter)")
        return 0
    else:
        os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels: set before the kernel modules are imported
    try:
        import triton
    except ImportError:
        print("bench_kernels: Triton is not installed (pip install triton), benchmark not run")
        return 0
    stem = "/tmp/bench_kernels_smoke" if args.cpu_smoke else str(DOCS / "bench_kernels")
    args.json, args.md = args.json or f"{stem}.json", args.md or f"{stem}.md"

    sweep = args.tune or args.quick
    default_contexts = QUICK_CONTEXTS if args.quick else FULL_CONTEXTS if args.tune else SHORT_CONTEXTS
    contexts = [int(c) for c in (args.contexts or default_contexts).split(",")]
    grid = [(16, 32, 4, 2)] if args.cpu_smoke else QUICK_GRID if args.quick else TUNE_GRID
    name = "cpu (Triton interpreter smoke run)" if args.cpu_smoke else torch.cuda.get_device_name()
    peak = peak_bandwidth(name)
    started = time.time()
    report = {
        "device": name, "torch": torch.__version__, "triton": triton.__version__,
        "peak_bandwidth_GBps": peak / 1e9 if peak else None, "batch": args.batch, "block_size": args.block_size,
        "mla_heads": args.mla_heads, "contexts": contexts, "copy_bandwidth_GBps": copy_bandwidth() / 1e9,
        "run": "sweep" if sweep else "short",
    }
    kernels = ("mla",) if args.skip_gqa else ("mla", "gqa")
    print(f"{name}: peak {report['peak_bandwidth_GBps']} GB/s, copy {report['copy_bandwidth_GBps']:.0f} GB/s", flush=True)
    report["checks"] = check_kernels() if sweep else check_short(args, {k: short_plan(k) for k in kernels})
    bad = [c for c in report["checks"] if not c["ok"]]
    print(f"checks: {len(report['checks']) - len(bad)}/{len(report['checks'])} ok" + (f"; FAILED: {bad}" if bad else ""), flush=True)
    for kernel in kernels:
        if sweep:
            report[kernel], report[f"{kernel}_tuning"] = bench_kernel(kernel, args, contexts, grid, peak)
        else:
            report[kernel] = bench_short(kernel, args, contexts, peak)
        add_ratios(report[kernel], report["copy_bandwidth_GBps"])
        write_json(args.json, report, indent=1)  # a run stopped later keeps the kernels done so far
    for kernel in kernels if not sweep else ():  # the peers last: their first calls JIT-compile
        report[kernel] += bench_peers(kernel, args, contexts, peak)
        add_ratios(report[kernel], report["copy_bandwidth_GBps"])
        write_json(args.json, report, indent=1)
        write_text(args.md, markdown(report))
    report["seconds"] = time.time() - started
    report["bench_rows"] = current_rows(report, run_info(DEVICE))
    write_json(args.json, report, indent=1)
    publish_rows(report, args.json)
    md = markdown(report)
    write_text(args.md, md)
    print(md)
    print(f"wrote {args.json} and {args.md} in {report['seconds']:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
