#!/usr/bin/env python
"""Distillation throughput and memory: tokens/s of kvconvert's Distiller, the loop `kvconvert heal`
runs, per micro-batch shape, and its peak memory beside kvconvert.heal.memory's estimate (the number the
refusal check uses), on a GPU or a CPU.

The teacher and the MLA student are randomly initialised models of a preset's shape (default SmolLM2-135M
-> MLA 160 + 32, the shape of recipes/smollm2-135m-50pct-gpu.yaml, whose distillation ran at 56-58K
tokens/s on an H100) and the tokens are random: weights and text do not change the speed or
the memory, and nothing large has to travel to a GPU machine. Each row builds a fresh Distiller, runs
--warmup optimizer steps untimed (compilation, allocator), then times --steps steps (device synchronised).

Measured peak: on a GPU torch.cuda.max_memory_allocated (reset before the Distiller is built); on a CPU the
peak RSS (VmHWM) of a fresh process per row, minus that process's RSS just before the Distiller is built
(the interpreter, torch, transformers and accelerate: "baseline_gb" in each row, not the run's). est/meas
is the estimate over that peak (the target: 1.0-1.3 on every row).

    python scripts/bench_distill.py --device cuda                         # the default grid, ~2 min on an H100
    python scripts/bench_distill.py --variants b8s2048,b16s2048:ckpt      # b<batch>s<seq_len>[:compile][:ckpt][:lora]
    python scripts/bench_distill.py --device cpu --layers 2 --variants b1s256,b2s512 --mixed-precision no
    python scripts/bench_distill.py --smoke                               # CPU: 2 layers, 64 tokens (plumbing only)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import DOCS, bench_rows, parser, publish_rows, run_info, write_json, write_text

# no torch.compile in the default grid: compiling the whole model took over 60 s of warm-up per row on an
# H100; ":compile" compiles each decoder layer (heal_distill's `compile`)
DEFAULT_VARIANTS = "b8s2048,b16s2048,b16s2048:ckpt,b8s2048:lora"
VARIANT = re.compile(r"b(\d+)s(\d+)((?::(?:compile|ckpt|lora))*)")


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--device", default="auto", help="auto (cuda when visible, else nothing is run), cuda[:N] or cpu")
    p.add_argument("--preset", default="smollm2-135m", help="model shape (kvconvert.presets)")
    p.add_argument("--rank", type=int, default=160, help="student kv_lora_rank")
    p.add_argument("--rope-dim", type=int, default=32, help="student qk_rope_head_dim")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="comma-separated b<batch>s<seq_len>[:compile][:ckpt (gradient checkpointing)][:lora]")
    p.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16", "fp16"], help="as heal_distill's")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per variant")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per variant")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary size (CPU tests)")
    p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the random checkpoints on disk (bfloat16 for a 7B pair)")
    p.add_argument("--stage", default="{}", help="more heal_distill options as JSON (e.g. the 7B recipe's block)")
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check: 2 layers, b2s64, 1 + 2 steps")
    p.add_argument("--profile", default=None, help="write a torch.profiler table of one more step of the first row "
                   "(where the step's time goes: kernels by device time) to this file")
    p.add_argument("--memory-trace", default=None, help="GPU: record one more step of the first row with torch's "
                   "allocator history and write what is live at its peak, grouped by the line that allocated it")
    p.add_argument("--json", default=None, help="default: docs/bench_distill.json (--smoke: /tmp/...)")
    p.add_argument("--md", default=None, help="default: docs/bench_distill.md (--smoke: /tmp/...)")
    # internal: the CPU rows, measured in a fresh process (JSON: model folders and variants)
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def parse_variant(text: str) -> dict:
    """'b8s2048:ckpt' -> {'batch': 8, 'seq_len': 2048, 'compile': False, 'ckpt': True, 'lora': False}."""
    m = VARIANT.fullmatch(text.strip())
    if not m:
        raise SystemExit(f"bad variant {text!r}: write b<batch>s<seq_len>, optionally :compile, :ckpt, :lora "
                         "(e.g. b8s2048:ckpt)")
    flags = set(m[3].split(":")[1:])
    return {"batch": int(m[1]), "seq_len": int(m[2]), **{f: f in flags for f in ("compile", "ckpt", "lora")}}


def random_model(cfg, dtype: torch.dtype, init_device: str = "cpu"):
    """A randomly initialised model of cfg, initialised on init_device (a GPU draws a 7B model's 6.7B
    values in seconds, the CPU in minutes); on the CPU when that fails."""
    from transformers import AutoModelForCausalLM

    if init_device != "cpu":
        try:
            with torch.device(init_device):
                return AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except Exception as e:  # noqa: BLE001 - the CPU path below is the reference
            print(f"bench_distill: init on {init_device} failed ({type(e).__name__}: {e}); initialising on the CPU")
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def build_models(preset: str, rank: int, rope_dim: int, layers: int | None, work: Path,
                 vocab: int | None = None, dtype: str = "float32", init_device: str = "cpu",
                 **overrides) -> tuple[Path, Path, int]:
    """Random teacher (the preset's config, `overrides` replacing fields) and random MLA student (the
    config `kvconvert mla` writes for it), saved as safetensors folders under `work` in `dtype` (bfloat16
    halves a 7B pair's disk; the Distiller loads the student in fp32 whatever the file holds);
    -> (student dir, teacher dir, vocab size)."""
    from transformers import AutoConfig

    from kvconvert import kvmath
    from kvconvert.mla.convert_layer import LayerPlan
    from kvconvert.mla.deepseek_format import deepseek_config
    from kvconvert.presets import get_preset

    src = dict(get_preset(preset)["config"])
    if layers:
        src["num_hidden_layers"] = layers
    if vocab:
        src["vocab_size"] = vocab
    src.update(overrides)
    teacher_cfg = AutoConfig.for_model(**src)
    plan = LayerPlan.for_source(kvmath.head_dim(src), rank, rope_dim)
    student_cfg = AutoConfig.for_model(**deepseek_config(teacher_cfg.to_dict(), rank, rope_dim, plan.nope_dim,
                                                         plan.v_dim, None, "float32"))
    dirs = []
    for name, cfg in (("teacher", teacher_cfg), ("student", student_cfg)):
        torch.manual_seed(0)
        model = random_model(cfg, getattr(torch, dtype), init_device)
        model.save_pretrained(work / name, safe_serialization=True)
        dirs.append(work / name)
        del model
    return dirs[1], dirs[0], src["vocab_size"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def stage_for(variant: dict, args) -> "DistillOptions":  # noqa: F821
    """The heal_distill options of a row: --stage's block, the variant's shape and switches."""
    from kvconvert.heal.options import DistillOptions

    steps = args.warmup + args.steps + extra_steps(args)
    base = {"warmup_steps": 1, "mixed_precision": args.mixed_precision, "checkpoint_every": 0,
            **json.loads(args.stage)}
    return DistillOptions(**{**base, "tokens": variant["batch"] * variant["seq_len"] * steps,
                             "seq_len": variant["seq_len"], "batch_size": variant["batch"], "grad_accum": 1,
                             "device": args.device,
                             **({"gradient_checkpointing": True} if variant["ckpt"] else {}),
                             **({"compile": True} if variant["compile"] else {}),
                             **({"train": "lora"} if variant["lora"] else {})})


def estimate(student: Path, teacher: Path, stage, device_type: str) -> dict:
    from kvconvert.checkpoint import read_config
    from kvconvert.heal.memory import distill_memory

    need = distill_memory(read_config(student), read_config(teacher), stage, device_type)
    return {"estimate_gb": need.allocated / 1e9,  # without the overhead: the peak is measured above the baseline
            "estimate_parts_gb": {k: round(v / 1e9, 4) for k, v in need.parts().items() if v}}


def rss(field: str) -> int:
    """This process's VmRSS / VmHWM (peak) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def warm_up_process(args, variant: dict, work: Path) -> None:
    """Run the same loop once on a tiny 1-layer model of the preset's family (same code paths), so the
    code torch, transformers and accelerate execute (their pages count in RSS) is loaded before the
    baseline is read; what that run allocated is freed again."""
    from kvconvert.heal.distill import Distiller

    student, teacher, vocab = build_models(args.preset, 16, 8, 1, work / "warm", 256, hidden_size=64,
                                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=16)
    tiny = {**variant, "batch": 1, "seq_len": 16, "compile": False}
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    d = Distiller(student, teacher, ids, stage_for(tiny, args), work / "warm" / "state", fingerprint="warm",
                  progress=False)
    for _ in range(2):
        d.train_step()
    del d
    gc.collect()


def measure(student: Path, teacher: Path, vocab: int, variant: dict, args, work: Path) -> dict:
    """One variant in this process: tokens/s over the timed steps and the peak memory of the run."""
    from kvconvert.heal.distill import Distiller

    if variant["compile"]:
        torch._dynamo.reset()  # each compiled row compiles for its own shape (no dynamic-shape recompile)
    stage = stage_for(variant, args)
    steps = args.warmup + args.steps + extra_steps(args)
    ids = torch.randint(0, vocab, (variant["batch"] * steps, variant["seq_len"]), generator=torch.Generator().manual_seed(0))
    cuda = stage.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
        baseline = rss("VmRSS")
    d = Distiller(student, teacher, ids, stage, work / "state", fingerprint="bench", progress=False)
    device = d.accelerator.device
    started = time.perf_counter()
    for _ in range(args.warmup):
        d.train_step()
    sync(device)
    warm_s = time.perf_counter() - started
    started = time.perf_counter()
    records = [d.train_step() for _ in range(args.steps)]
    sync(device)
    seconds = time.perf_counter() - started
    peak = (torch.cuda.max_memory_allocated() if cuda else rss("VmHWM")) - baseline
    for path, extra in ((profile_path(args, variant), profile_step), (trace_path(args, cuda), trace_step)):
        if path:
            try:
                extra(d, device, path)
            except Exception as e:  # noqa: BLE001 - a diagnostic that fails must not cost the row
                write_text(path, f"{extra.__name__} failed: {type(e).__name__}: {e}\n")
    timed_tokens = sum(r["tokens"] for r in records)
    est = estimate(student, teacher, stage, device.type)
    switches = {"ckpt": stage.gradient_checkpointing, "lora": stage.train == "lora"}  # --stage may set them
    return {**variant, **switches, "tokens_per_s": timed_tokens / seconds, "step_s": seconds / args.steps, "warmup_s": warm_s,
            "peak_gb": peak / 1e9, "baseline_gb": baseline / 1e9, **est, "est_over_measured": est["estimate_gb"] * 1e9 / peak,
            "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"], "device": str(device)}


def extra_steps(args) -> int:
    """Window batches beyond warm-up + timed steps: one each for --profile's and --memory-trace's step."""
    return bool(args.profile) + bool(getattr(args, "memory_trace", None))


def profile_path(args, variant: dict) -> str | None:
    """Where to write this row's profile: --profile for the first row, <stem>_compile.txt for the first
    compiled row; None for the others (each kind profiled once)."""
    if not args.profile:
        return None
    kind = "compile" if variant["compile"] else "eager"
    done = args.__dict__.setdefault("profiled", set())
    if kind in done:
        return None
    done.add(kind)
    path = Path(args.profile)
    return str(path.with_name(f"{path.stem}_compile{path.suffix}")) if kind == "compile" else str(path)


def trace_path(args, cuda: bool) -> str | None:
    """--memory-trace for the first row on a GPU (the allocator history is CUDA's), then None."""
    path, args.memory_trace = getattr(args, "memory_trace", None), None
    return path if cuda else None


LIBRARY_MARKERS = ("/transformers/", "/kvconvert/", "/accelerate/", "bench_distill")


def frame_label(frames: list[dict]) -> str:
    """The innermost frame of an allocation inside transformers, kvconvert, accelerate or this script
    ("file:line function"); allocations made by autograd's engine have no Python frame."""
    for f in frames:
        name = f.get("filename", "")
        if any(m in name for m in LIBRARY_MARKERS):
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "<no library frame: autograd backward or torch internals>" if not frames else \
        f"<torch: {frames[0].get('name')}>"


def peak_allocations(events: list[dict]) -> tuple[int, dict[str, list[int]]]:
    """Replay an allocator trace (torch.cuda.memory._snapshot()['device_traces'][i]: dicts with action,
    addr, size, frames): -> (the traced bytes live at their peak, {label: [bytes, blocks]} of the blocks
    live at that moment, labelled by frame_label)."""
    live: dict[int, dict] = {}
    current = peak = 0
    at_peak: dict[int, dict] = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            current += e["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            current -= live.pop(e["addr"])["size"]
    groups: dict[str, list[int]] = {}
    for e in at_peak.values():
        g = groups.setdefault(frame_label(e.get("frames") or []), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    return peak, groups


def trace_step(d, device: torch.device, path: str) -> None:
    """One more optimizer step with the CUDA allocator's history recorded; writes the peak and what is
    live at it (beyond what was allocated before the step: the models, gradients, optimizer states)."""
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2_000_000)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    d.train_step()
    sync(device)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][device.index or 0]
    peak, groups = peak_allocations(events)
    lines = [f"before the step: {base / 1e9:.3f} GB allocated; the step's own peak {peak / 1e9:.3f} GB (traced, "
             f"{len(events)} events); max_memory_allocated {torch.cuda.max_memory_allocated(device) / 1e9:.3f} GB", "",
             "GB live at the peak | blocks | allocated at"]
    for label, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:40]:
        lines.append(f"{size / 1e9:10.4f} | {count:5d} | {label}")
    write_text(path, "\n".join(lines) + "\n")


def profile_step(d, device: torch.device, path: str) -> None:
    """One more optimizer step under torch.profiler; its operators sorted by self device time (CPU time on
    a CPU) go to `path` as a table: which kernels a distillation step spends its time in."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        d.train_step()
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    write_text(path, prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70))


def measure_in_child(student: Path, teacher: Path, vocab: int, variants: list[dict], args, work: Path) -> list[dict]:
    """CPU rows in one fresh process, after a warm-up, each measured from its own baseline. glibc's
    allocator is told to return every freed block over 64 KiB at once (its default threshold grows to
    32 MiB, and freed tensors below it would stay in RSS): RSS then follows the live tensors, and one
    row's freed memory neither hides the next row's peak nor counts in it."""
    spec = json.dumps({"student": str(student), "teacher": str(teacher), "vocab": vocab, "variants": variants,
                       "work": tempfile.mkdtemp(dir=work), "preset": args.preset, "rank": args.rank,
                       "rope_dim": args.rope_dim})
    argv = [sys.executable, __file__, "--row", spec, "--device", args.device, "--mixed-precision", args.mixed_precision,
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--stage", args.stage,
            *(["--profile", args.profile] if args.profile else [])]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode:
        rows.append({**variants[min(len(rows), len(variants) - 1)],
                     "error": f"row process failed (rc {proc.returncode}): {proc.stderr[-400:]}"})
    return rows


def run_rows(args) -> int:
    """--row: the CPU rows of measure_in_child, in this process, one JSON line each."""
    spec = json.loads(args.row)
    args.preset, args.rank, args.rope_dim = spec["preset"], spec["rank"], spec["rope_dim"]
    work = Path(spec["work"])
    warm_up_process(args, spec["variants"][0], work)  # the libraries' code and data are the process's, not the run's
    for i, variant in enumerate(spec["variants"]):
        gc.collect()
        row = measure(Path(spec["student"]), Path(spec["teacher"]), spec["vocab"], variant, args, work / str(i))
        print(json.dumps(row), flush=True)
    return 0


def markdown(report: dict) -> str:
    lines = [f"Distillation on {report['device_name']} ({report['preset']} -> MLA {report['rank']} + "
             f"{report['rope_dim']}, {report['layers'] or 'all'} layers, random weights and tokens, mixed precision "
             f"{report['mixed_precision']}; {report['steps']} timed steps after {report['warmup']}; peak: "
             f"{report['peak_kind']}):", "",
             "| micro-batch | seq_len | compile | ckpt | lora | tokens/s | step (s) | warm-up (s) | peak GB | estimate GB | est/meas |",
             "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    yes = {True: "yes", False: "no"}
    for r in report["rows"]:
        head = f"| {r['batch']} | {r['seq_len']} | {yes[r['compile']]} | {yes[r['ckpt']]} | {yes[r['lora']]} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} | | | | | |")
            continue
        lines.append(f"{head} {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | {r['warmup_s']:.1f} | {r['peak_gb']:.2f} | "
                     f"{r['estimate_gb']:.2f} | {r['est_over_measured']:.2f} |")
    return "\n".join(lines) + "\n"


def current_rows(report: dict, info: dict | None = None, cmd: str | None = None) -> dict:
    """Each row's peak beside the estimate (docs/BENCHMARKS.md's memory table) and, on a GPU, its tokens/s (the
    healing table); CPU tokens/s on a shared machine mean nothing and are left out."""
    memory, speed = [], []
    options = sorted((report.get("stage") or {}).items())
    stage = ", heal_distill " + " ".join(f"{k}={'+'.join(map(str, v)) if isinstance(v, list) else v}"
                                         for k, v in options) if options else ""
    gb = lambda x: f"{x:.3f}" if x < 1 else f"{x:.2f}"  # noqa: E731 - CPU rows are a few hundred MB
    for r in report["rows"]:
        if "error" in r:
            continue
        switches = "".join(f", {k}" for k in ("compile", "ckpt", "lora") if r[k])
        what = (f"distillation {report['preset']} -> MLA {report['rank']}+{report['rope_dim']}, "
                f"{report['layers'] or 'all'} layers, mixed precision {report['mixed_precision']}{stage}, "
                f"{r['batch']} x {r['seq_len']}{switches}")
        memory.append((f"{what}: peak memory vs estimate ({report['peak_kind']})",
                       f"{gb(r['peak_gb'])} GB measured, {gb(r['estimate_gb'])} GB estimated ({r['est_over_measured']:.2f}x)"))
        if r.get("device", "").startswith("cuda"):
            speed.append((f"{what}: tokens/s", f"{r['tokens_per_s']:,.0f} tokens/s ({r['step_s']:.3f} s per step)"))
    return {"memory": bench_rows(memory, info, cmd), **({"healing": bench_rows(speed, info, cmd)} if speed else {})}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.row:
        return run_rows(args)
    if args.smoke:
        args.layers, args.warmup, args.steps, args.mixed_precision, args.device = 2, 1, 2, "no", "cpu"
        args.variants = "b2s64" if args.variants == DEFAULT_VARIANTS else args.variants
    variants = [parse_variant(v) for v in args.variants.split(",")]
    if args.device == "auto":
        if not torch.cuda.is_available():
            print("bench_distill: no CUDA GPU visible, benchmark not run (--device cpu runs it on the CPU; --smoke "
                  "checks the plumbing)")
            return 0
        args.device = "cuda"
    cuda = args.device.startswith("cuda")
    stem = "/tmp/bench_distill_smoke" if args.smoke else str(DOCS / "bench_distill")
    args.json, args.md = args.json or f"{stem}.json", args.md or f"{stem}.md"
    report = {"preset": args.preset, "rank": args.rank, "rope_dim": args.rope_dim, "layers": args.layers, "vocab": args.vocab,
              "mixed_precision": args.mixed_precision, "warmup": args.warmup, "steps": args.steps,
              "stage": json.loads(args.stage), "device_name": torch.cuda.get_device_name() if cuda else "cpu",
              "peak_kind": "torch.cuda.max_memory_allocated" if cuda else "VmHWM - RSS before the Distiller, own process",
              "torch": torch.__version__, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench_distill_") as tmp:
        work = Path(tmp)
        student, teacher, vocab = build_models(args.preset, args.rank, args.rope_dim, args.layers, work, args.vocab,
                                               args.save_dtype, args.device if cuda else "cpu")
        if cuda:
            torch.cuda.empty_cache()
        if not cuda:
            report["rows"] = measure_in_child(student, teacher, vocab, variants, args, work)
        for variant in variants if cuda else []:
            gc.collect()  # the previous row's Distiller (a reference cycle through accelerate) goes first
            try:
                row = measure(student, teacher, vocab, variant, args, work)
            except Exception as e:  # noqa: BLE001 - an out-of-memory or compile failure is a row, not the end
                row = {**variant, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            report["rows"].append(row)
            print(row, flush=True)
            write_json(args.json, report, indent=1)  # a run stopped later keeps the variants done so far
            torch.cuda.empty_cache()
        report["bench_rows"] = current_rows(report, run_info(args.device))
        write_json(args.json, report, indent=1)
        publish_rows(report, args.json)
    md = markdown(report)
    write_text(args.md, md)
    print(md)
    return 1 if any("error" in r for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
