#!/usr/bin/env python
"""Distillation loss over the vocabulary: the fused, chunked loss vs plain autograd, side by side.

  python scripts/bench_heal_loss.py [--rows 2048] [--vocab 49152] [--dtypes fp32,bf16] [--repeats 3]
                                    [--device cpu|cuda] [--no-doc]

Each (variant, dtype) runs in its own child process: forward + backward of KL (+0.5 CE) on random
student/teacher logits [rows, vocab] (rows = batch x seq_len positions; SmolLM2's vocabulary by
default). Reported: median seconds per forward+backward and the peak memory the loss adds on top of
its inputs (CPU: the child's VmHWM, reset once the inputs are made, minus its RSS then; CUDA:
max_memory_allocated minus the inputs). Writes docs/bench_heal_loss.json and the table between the
bench_heal_loss markers in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from bench_common import DOCS, bench_rows, command, parser, publish_rows, run_info, write_block, write_json

JSON_OUT = DOCS / "bench_heal_loss.json"


def _status_bytes(field: str) -> int:
    """VmRSS / VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS, so making the inputs does not count."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(variant: str, dtype: str, rows: int, vocab: int, repeats: int, device: str) -> dict:
    import torch

    from kvconvert.heal.fused_loss import fused_distill_loss, next_token_targets, reference_distill_loss
    from kvconvert.kvformat import torch_dtype

    fn = {"fused": fused_distill_loss, "reference": reference_distill_loss}[variant]
    dt = torch_dtype(dtype)
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(1, rows, vocab, generator=g) * 3).to(device, dt)
    teacher = (student.float() + torch.randn(1, rows, vocab, generator=g).to(device)).to(dt)
    targets = next_token_targets(torch.randint(0, vocab, (1, rows), generator=g)).to(device)
    z = student.requires_grad_(True)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak_rss()
        base = _status_bytes("VmRSS")
    times = []
    for _ in range(repeats):
        z.grad = None
        t0 = time.perf_counter()
        loss, _ = fn(z, teacher, targets, kl_weight=1.0, lm_weight=0.5)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM")
    return {"variant": variant, "dtype": dtype, "rows": rows, "vocab": vocab, "device": device,
            "seconds": round(statistics.median(times), 3), "loss": round(float(loss), 6),
            "extra_memory_gb": round((peak - base) / 1e9, 3)}


def markdown(rows: list[dict], command: str) -> str:
    lines = ["| logits dtype | rows x vocab | variant | s per forward+backward | memory over the inputs | loss |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['rows']} x {r['vocab']} | {r['variant']} | {r['seconds']} | "
                     f"{r['extra_memory_gb']:.2f} GB | {r['loss']} |")
    return "\n".join(lines) + f"\n\nCommand: `{command}` (device {rows[0]['device']})"


def current_rows(results: list[dict], info: dict | None = None, cmd: str | None = None) -> dict:
    """The fused loss against the reference per logits dtype, for docs/BENCHMARKS.md's healing table."""
    rows = []
    for fused in (r for r in results if r["variant"] == "fused"):
        ref = next((r for r in results if r["variant"] == "reference" and r["dtype"] == fused["dtype"]), None)
        than = f" (reference: {ref['seconds']} s, {ref['extra_memory_gb']:.2f} GB)" if ref else ""
        rows.append((f"fused distillation loss (KL + 0.5 CE), {fused['rows']} x {fused['vocab']} {fused['dtype']} logits: "
                     "s per forward + backward, memory over the inputs",
                     f"{fused['seconds']} s, {fused['extra_memory_gb']:.2f} GB{than}"))
    return {"healing": bench_rows(rows, info, cmd)}


def main():
    if sys.argv[1:2] == ["_child"]:
        v, d, rows, vocab, reps, dev = sys.argv[2:8]
        print(json.dumps(child(v, d, int(rows), int(vocab), int(reps), dev)))
        return
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    results = []
    for dtype in args.dtypes.split(","):
        for variant in ("reference", "fused"):
            out = subprocess.run([sys.executable, __file__, "_child", variant, dtype, str(args.rows), str(args.vocab),
                                  str(args.repeats), args.device], capture_output=True, text=True, check=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    payload = {"command": command(), "results": results, "bench_rows": current_rows(results, run_info(args.device))}
    write_json(JSON_OUT, payload)
    table = markdown(results, command())
    if not args.no_doc:
        write_block("bench_heal_loss", table)
        publish_rows(payload, JSON_OUT)
    print(table)


if __name__ == "__main__":
    main()
