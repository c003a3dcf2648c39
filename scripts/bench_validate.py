#!/usr/bin/env python
"""Time `kvconvert validate` on SmolLM2-135M against itself (every sample recomputed).

    python scripts/bench_validate.py --suite quick [--engine runtime|transformers] [--threads 1]

Prints wall time per phase, the process's CPU time and the load average before and after. On
a CPU shared with other jobs the wall time is inflated by their load; with --threads 1 the CPU
time is a load-independent estimate of the single-core wall time. The deltas must be exactly 0
(same model, same inputs, deterministic): the script exits 1 otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from bench_common import bench_rows, parser, publish_rows, stopwatch, write_json


def current_rows(result: dict, info: dict | None = None, cmd: str | None = None) -> dict:
    """The run's time and its largest delta, for docs/BENCHMARKS.md's validation table."""
    return {"validation": bench_rows([(
        f"{result.get('source', 'smollm2-135m')} validated against itself, {result['suite']} suite on {result['engine']}, "
        f"{result['threads']} thread(s): wall and CPU time, largest delta",
        f"{result['wall_s']} s wall, {result['cpu_s']} CPU-s (load {result['load_before'][0]} at the start); "
        f"largest delta {result['max_abs_delta']}")], info, cmd)}


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--suite", default="quick")
    ap.add_argument("--engine", default="auto", choices=["auto", "runtime", "transformers"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=None, help="report folder (default: a temp folder)")
    ap.add_argument("--json", type=Path, default=None, help="also write the timings here")
    args = ap.parse_args()

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from kvconvert.eval.options import ValidateOptions
    from kvconvert.eval.validate import run_validate
    from kvconvert.sources import resolve_source

    source = resolve_source(args.source)  # import the model first: not part of the timing
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_validate_"))
    load_before = os.getloadavg()
    with stopwatch() as times:
        report = run_validate(str(source), str(source), out, ValidateOptions(suite=args.suite, engine=args.engine),
                              resume=False, progress=False, threads=args.threads)
    result = {
        "suite": args.suite, "engine": report["source"]["engine"], "threads": report["settings"]["threads"],
        "wall_s": times["seconds"], "cpu_s": times["cpu_seconds"], "phase_s": report["phase_seconds"],
        "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
        "cores": os.cpu_count(),
        "samples": {task: len(records) for task, records in report["samples"].items()},
        "max_abs_delta": max(abs(m["delta"]) for m in report["metrics"].values()),
        "report": str(out / "report.json"), "source": args.source,
    }
    result["bench_rows"] = current_rows(result)
    print(json.dumps(result, indent=1))
    if args.json:
        write_json(args.json, result, indent=1)
        publish_rows(result, args.json)
    return 0 if result["max_abs_delta"] == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
