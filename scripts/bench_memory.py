#!/usr/bin/env python
"""Peak memory and wall time of each stage on random-weight checkpoints in real models' shapes.

  python scripts/bench_memory.py [--shapes tinyllama-1.1b,llama-2-7b] [--stages mla,calibrate,generate,validate]
                                 [--workdir DIR] [--keep] [--threads N (default 1)]

Children run with OMP_NUM_THREADS=--threads (default 1: on a CPU shared with other jobs, two
OpenMP threads spin against each other and a bf16 matrix-vector product can take 100x longer).

Each stage is the real command run in its own child process; its peak RSS is that child's own
ru_maxrss (os.wait4), not the bench's. Linux carries the parent's RSS high-water mark into a
child across fork + exec, so this process imports no torch (it stays ~15 MB, the floor of every
figure) and writes the random checkpoints in a child too. Stages:
  mla        kvconvert mla, 256 + 64 for TinyLlama, 512 + 64 for the 7B (TinyLlama only by default: the
             7B-shaped conversion takes over an hour here; docs/BENCHMARKS.md has its 3.57 GB / 84.5 min
             run; --layers N cuts the depth, which a streaming stage's peak must not depend on)
  calibrate  kvconvert calibrate --kv-dtype fp8 (--calib-tokens, default 2048)
  calibrate-mla  kvconvert calibrate --kv-dtype nvfp4 of the mla stage's output: the latent shaping
             path (its extra statistics pass and weight fold); the row records how many layers it shaped
  generate   kvconvert generate, 8 new tokens, greedy, --dtype auto (bf16 as stored); generate-fp32
             the same with --dtype fp32 (TinyLlama only by default, for comparison)
  validate   kvconvert validate's run_validate, smoke-sized: 2 perplexity/KL windows of 512 tokens
             plus one 512-token passkey sample, runtime engine; candidate = the MLA output when that
             stage ran, else the source itself with an FP8 KV cache (dynamic scales), so both
             models really run.
Writes docs/bench_memory.json (merged per shape) and the table in docs/BENCHMARKS.md (between
the bench_memory markers). Random weights prove memory and speed, not quality.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_common import DOCS, bench_rows, command, parser, publish_rows, run_child, write_block, write_json
from bench_mla import LLAMA_SHAPES  # one source of truth for random checkpoints; no torch

JSON_OUT = DOCS / "bench_memory.json"
DEFAULT_STAGES = {"tinyllama-1.1b": ["mla", "calibrate", "generate", "generate-fp32", "validate"],
                  "llama-2-7b": ["generate", "validate"]}
MLA_SHAPE = {"tinyllama-1.1b": ("256", "64"), "llama-2-7b": ("512", "64")}  # rank, rope-dim
TARGETS_GB = {("tinyllama-1.1b", "generate"): 3.5, ("llama-2-7b", "generate"): 16.0,
              ("tinyllama-1.1b", "calibrate"): 1.5, ("llama-2-7b", "calibrate"): 4.0,
              ("llama-2-7b", "calibrate-mla"): 4.0}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
KVCONVERT = [sys.executable, "-m", "kvconvert.cli"]


def stage_command(stage: str, shape: str, src: Path, work: Path, args, ran: set[str]) -> list[str]:
    threads = ["--threads", str(args.threads)] if args.threads else []
    if stage == "mla":
        rank, rope = MLA_SHAPE[shape]
        return [*KVCONVERT, "mla", "--src", str(src), "--rank", rank, "--rope-dim", rope, "--out", str(work / "mla"),
                "--overwrite", "--heal", "none", "--calib-tokens", "512", "--calib-window", "256", "--dtype", "bf16"]
    if stage == "calibrate":
        return [*KVCONVERT, "calibrate", "--src", str(src), "--kv-dtype", "fp8", "--out", str(work / "fp8"),
                "--overwrite", "--calib-tokens", str(args.calib_tokens), "--window-len", "512", "--quiet", *threads]
    if stage == "calibrate-mla":
        return [*KVCONVERT, "calibrate", "--src", str(work / "mla"), "--kv-dtype", "nvfp4",
                "--out", str(work / "nvfp4"),
                "--overwrite", "--calib-tokens", str(args.calib_tokens), "--window-len", "512", "--quiet", *threads]
    if stage.startswith("generate"):
        dtype = "fp32" if stage == "generate-fp32" else "auto"
        return [*KVCONVERT, "generate", "--model", str(src), "--prompt", PROMPT, "--max-new-tokens", "8", "--greedy",
                "--json", "--dtype", dtype]
    if stage == "validate":
        mla = work / "mla"
        candidate = ["--candidate", str(mla)] if "mla" in ran and (mla / "config.json").is_file() else \
            ["--candidate", str(src), "--kv-dtype", "fp8", "--kv-scales", "dynamic"]
        return [sys.executable, __file__, "_validate", "--source", str(src), *candidate,
                "--out", str(work / "report"), *threads]
    raise SystemExit(f"unknown stage {stage}")


def write_source(src: Path, shape: str, layers: int | None) -> None:
    """The random checkpoint, written by a child process (see the module docstring)."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from pathlib import Path; "
            "from bench_mla import write_random_llama; from kvconvert.sources import resolve_source; "
            f"write_random_llama(Path({str(src)!r}), resolve_source('smollm2-135m'), {shape!r}, {layers!r})")
    t0 = time.time()
    subprocess.run([sys.executable, "-c", code], check=True)
    print(f"wrote {src} in {time.time() - t0:.0f} s", flush=True)


def shaped_layers(report: Path) -> str:
    """'S of L layers shaped' from a calibration_report.json (calibrate's rotation description)."""
    shaping = (json.loads(report.read_text()).get("rotation") or {}).get("latent_shaping") or {}
    total = len(shaping.get("predicted_noise_ratio_per_layer", []))
    return f"{total - len(shaping.get('unshaped_layers', []))} of {total} layers shaped"


def shape_key(shape: str, layers: int | None) -> str:
    return shape if layers is None else f"{shape}/{layers}L"


def bench_shape(shape: str, stages: list[str], args) -> dict:
    work = Path(args.workdir) / shape_key(shape, args.layers).replace("/", "-")
    src = work / "source"
    if not (src / "config.json").is_file():
        write_source(src, shape, args.layers)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    rows, ran = {}, set()
    for stage in stages:
        shutil.rmtree(work / "report", ignore_errors=True)  # validate must compute, not reuse a cache
        row = run_child(stage_command(stage, shape, src, work, args, ran), work / f"{stage}.log", args.threads)
        target = TARGETS_GB.get((shape, stage))
        if target:
            row["target_gb"] = target
        if stage == "calibrate-mla" and row["rc"] == 0:
            row["note"] = shaped_layers(work / "nvfp4" / "calibration_report.json")
        rows[stage] = row
        ran.add(stage) if row["rc"] == 0 else None
        print(json.dumps({"shape": shape, "stage": stage, **row}), flush=True)
    for name in ("mla", "fp8", "nvfp4", "report"):
        shutil.rmtree(work / name, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    config = {**LLAMA_SHAPES[shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    return {"shape": shape_key(shape, args.layers), "weights_gb": round(size / 1e9, 2), "config": config,
            "stages": rows}


def markdown(results: dict) -> str:
    lines = ["| shape (random bf16 weights) | stage | peak RSS (child) | target | wall time |", "|---|---|---|---|---|"]
    for shape, r in results.items():
        if not isinstance(r, dict) or "stages" not in r:
            continue
        for stage, row in r["stages"].items():
            target = f"< {row['target_gb']} GB" if row.get("target_gb") else "-"
            rss = f"{row['peak_rss_gb']:.2f} GB" if row["rc"] == 0 else f"failed (rc {row['rc']})"
            note = f" ({row['note']})" if row.get("note") else ""
            lines.append(f"| {shape} ({r['weights_gb']} GB) | {stage}{note} | {rss} | {target} | {row['seconds']} s |")
    return "\n".join(lines)


def current_rows(shapes: list[dict], info: dict | None = None, cmd: str | None = None) -> dict:
    """The stages these shapes' results hold, each a row of docs/BENCHMARKS.md's memory table: the child's peak
    RSS against its target, and its wall time."""
    rows = []
    for r in shapes:
        for stage, row in r["stages"].items():
            if row["rc"] != 0:
                continue
            target = f" (target < {row['target_gb']} GB)" if row.get("target_gb") else ""
            note = f" ({row['note']})" if row.get("note") else ""
            rows.append((f"{r['shape']} (random bf16, {r['weights_gb']} GB) `{stage}`{note}: peak RSS of the stage's "
                         f"process{target}", f"{row['peak_rss_gb']:.2f} GB, {row['seconds']} s wall"))
    return {"memory": bench_rows(rows, info, cmd)}


def validate_child(argv: list[str]) -> None:
    """The validate stage's child: run_validate on the smoke-sized suite."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--source")
    ap.add_argument("--candidate")
    ap.add_argument("--out")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--kv-scales", default="checkpoint")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    from kvconvert.eval.suites import SuiteSpec
    from kvconvert.eval.options import ValidateOptions
    from kvconvert.eval.validate import run_validate

    suite = SuiteSpec(name="bench-memory", description="smoke-sized: 2 x 512-token windows, one passkey",
                      ppl_windows=2, ppl_window_len=512, passkey_lengths=(512,), passkey_depths=(0.5,), longbench=False)
    run_validate(a.source, a.candidate, Path(a.out), ValidateOptions(engine="runtime", kv_dtype=a.kv_dtype,
                                                                     kv_scales=a.kv_scales),
                 spec=suite, progress=False, threads=a.threads)


def main():
    if sys.argv[1:2] == ["_validate"]:
        return validate_child(sys.argv[2:])
    ap = parser(__doc__)
    ap.add_argument("--shapes", default="tinyllama-1.1b")
    ap.add_argument("--stages", default=None, help="comma list (default per shape: see DEFAULT_STAGES)")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the random checkpoints "
                    "(default: the real model's); the rows are keyed SHAPE/NL")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS (and --threads) of every stage")
    ap.add_argument("--workdir", default=os.environ.get("TMPDIR", "/tmp") + "/kvc-bench-memory")
    ap.add_argument("--keep", action="store_true", help="keep the random checkpoints for reruns")
    ap.add_argument("--no-doc", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    args = ap.parse_args()
    results = json.loads(JSON_OUT.read_text()) if JSON_OUT.is_file() else {}
    measured = []
    for shape in args.shapes.split(","):
        if shape not in LLAMA_SHAPES:
            raise SystemExit(f"unknown shape {shape}; choose from {', '.join(LLAMA_SHAPES)}")
        stages = args.stages.split(",") if args.stages else DEFAULT_STAGES[shape]
        fresh = bench_shape(shape, stages, args)
        measured.append({**fresh})
        old = results.get(fresh["shape"], {})  # a run of some stages updates those rows only
        fresh["stages"] = {**old.get("stages", {}), **fresh["stages"]}
        fresh["commands"] = list(dict.fromkeys(old.get("commands", []) + [command()]))
        results[fresh["shape"]] = fresh
    results["command"] = "; ".join(dict.fromkeys(c for r in results.values() if isinstance(r, dict)
                                                 for c in r.get("commands", [])))
    results["bench_rows"] = current_rows(measured)
    write_json(JSON_OUT, results)
    if not args.no_doc:
        write_block("bench_memory", f"{markdown(results)}\n\nCommand: `{results['command']}`")
        publish_rows(results, JSON_OUT)
    print(markdown(results))


if __name__ == "__main__":
    main()
