#!/usr/bin/env python
"""Distillation throughput (issue 17, item 3): tokens/s of kvconvert's Distiller, the loop `kvconvert heal`
runs, per micro-batch shape and with or without torch.compile, on a GPU.

The teacher and the MLA student are randomly initialised models of a preset's shape (default SmolLM2-135M
-> MLA 160 + 32, the shape of recipes/smollm2-135m-50pct-gpu.yaml, whose distillation ran at 56-58K
tokens/s on an H100 in session 5) and the tokens are random: weights and text do not change the speed,
and nothing large has to travel to a GPU machine. Each variant builds a fresh Distiller, runs
--warmup optimizer steps untimed (compilation, allocator), then times --steps steps (device
synchronised) and records the peak device memory. Writes a JSON and a markdown table.

    python scripts/bench_distill.py --device cuda                         # the default grid, ~2-4 min on an H100
    python scripts/bench_distill.py --variants b8s2048,b16s2048:compile   # b<batch>s<seq_len>[:compile]
    python scripts/bench_distill.py --smoke                               # CPU: 2 layers, 64 tokens (plumbing only)
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import DOCS, parser, write_json, write_text

DEFAULT_VARIANTS = "b8s2048,b8s2048:compile,b16s2048,b16s2048:compile,b32s1024:compile"


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--preset", default="smollm2-135m", help="model shape (kvconvert.presets)")
    p.add_argument("--rank", type=int, default=160, help="student kv_lora_rank")
    p.add_argument("--rope-dim", type=int, default=32, help="student qk_rope_head_dim")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated b<batch>s<seq_len>[:compile]")
    p.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16", "fp16"], help="as heal_distill's")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps per variant")
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per variant")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check: 2 layers, b2s64, 1 + 2 steps")
    p.add_argument("--json", default=None, help="default: docs/bench_distill.json (--smoke: /tmp/...)")
    p.add_argument("--md", default=None, help="default: docs/bench_distill.md (--smoke: /tmp/...)")
    return p.parse_args(argv)


def parse_variant(text: str) -> dict:
    """'b8s2048:compile' -> {'batch': 8, 'seq_len': 2048, 'compile': True}."""
    m = re.fullmatch(r"b(\d+)s(\d+)(:compile)?", text.strip())
    if not m:
        raise SystemExit(f"bad variant {text!r}: write b<batch>s<seq_len>, optionally :compile (e.g. b8s2048:compile)")
    return {"batch": int(m[1]), "seq_len": int(m[2]), "compile": bool(m[3])}


def build_models(preset: str, rank: int, rope_dim: int, layers: int | None, work: Path) -> tuple[Path, Path, int]:
    """Random teacher (the preset's config) and random MLA student (the config `kvconvert mla` writes for
    it), saved as safetensors folders under `work`; -> (student dir, teacher dir, vocab size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvconvert import kvmath
    from kvconvert.mla.convert_layer import LayerPlan
    from kvconvert.mla.deepseek_format import deepseek_config
    from kvconvert.presets import get_preset

    src = dict(get_preset(preset)["config"])
    if layers:
        src["num_hidden_layers"] = layers
    teacher_cfg = AutoConfig.for_model(**src)
    plan = LayerPlan.for_source(kvmath.head_dim(src), rank, rope_dim)
    student_cfg = AutoConfig.for_model(**deepseek_config(teacher_cfg.to_dict(), rank, rope_dim, plan.nope_dim,
                                                         plan.v_dim, None, "float32"))
    dirs = []
    for name, cfg in (("teacher", teacher_cfg), ("student", student_cfg)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(work / name, safe_serialization=True)
        dirs.append(work / name)
        del model
    return dirs[1], dirs[0], src["vocab_size"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(student: Path, teacher: Path, vocab: int, variant: dict, args, work: Path) -> dict:
    """One variant: tokens/s over the timed steps and peak device memory."""
    from kvconvert.heal.distill import Distiller
    from kvconvert.heal.options import DistillOptions

    steps = args.warmup + args.steps
    tokens = variant["batch"] * variant["seq_len"] * steps
    stage = DistillOptions(tokens=tokens, seq_len=variant["seq_len"], batch_size=variant["batch"], warmup_steps=1,
                           mixed_precision=args.mixed_precision, checkpoint_every=0)
    ids = torch.randint(0, vocab, (variant["batch"] * steps, variant["seq_len"]), generator=torch.Generator().manual_seed(0))
    d = Distiller(student, teacher, ids, stage, work / "state", fingerprint="bench", progress=False)
    if variant["compile"]:
        d.student, d.teacher = torch.compile(d.student), torch.compile(d.teacher)
    device = d.accelerator.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(args.warmup):
        d.train_step()
    sync(device)
    warm_s = time.perf_counter() - started
    started = time.perf_counter()
    records = [d.train_step() for _ in range(args.steps)]
    sync(device)
    seconds = time.perf_counter() - started
    timed_tokens = sum(r["tokens"] for r in records)
    return {**variant, "tokens_per_s": timed_tokens / seconds, "step_s": seconds / args.steps, "warmup_s": warm_s,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
            "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"], "device": str(device)}


def markdown(report: dict) -> str:
    lines = [f"Distillation throughput on {report['device_name']} ({report['preset']} -> MLA {report['rank']} + "
             f"{report['rope_dim']}, random weights and tokens, mixed precision {report['mixed_precision']}; "
             f"{report['steps']} timed steps after {report['warmup']}):", "",
             "| micro-batch | seq_len | torch.compile | tokens/s | step (s) | warm-up (s) | peak GB |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['seq_len']} | {'yes' if r['compile'] else 'no'} | failed: {r['error']} | | | |")
            continue
        peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
        lines.append(f"| {r['batch']} | {r['seq_len']} | {'yes' if r['compile'] else 'no'} | {r['tokens_per_s']:.0f} | "
                     f"{r['step_s']:.3f} | {r['warmup_s']:.1f} | {peak} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.layers, args.warmup, args.steps, args.mixed_precision = 2, 1, 2, "no"
        args.variants = "b2s64" if args.variants == DEFAULT_VARIANTS else args.variants
    variants = [parse_variant(v) for v in args.variants.split(",")]
    if not args.smoke and not torch.cuda.is_available():
        print("bench_distill: no CUDA GPU visible, benchmark not run (--smoke checks the plumbing on CPU)")
        return 0
    stem = "/tmp/bench_distill_smoke" if args.smoke else str(DOCS / "bench_distill")
    args.json, args.md = args.json or f"{stem}.json", args.md or f"{stem}.md"
    report = {"preset": args.preset, "rank": args.rank, "rope_dim": args.rope_dim, "layers": args.layers,
              "mixed_precision": args.mixed_precision, "warmup": args.warmup, "steps": args.steps,
              "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench_distill_") as tmp:
        work = Path(tmp)
        student, teacher, vocab = build_models(args.preset, args.rank, args.rope_dim, args.layers, work)
        for variant in variants:
            try:
                row = measure(student, teacher, vocab, variant, args, work)
            except Exception as e:  # noqa: BLE001 - an out-of-memory or compile failure is a row, not the end
                row = {**variant, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            report["rows"].append(row)
            print(row, flush=True)
            write_json(args.json, report, indent=1)  # a run stopped later keeps the variants done so far
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    md = markdown(report)
    write_text(args.md, md)
    print(md)
    return 1 if any("error" in r for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
