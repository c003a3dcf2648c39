"""What the benchmark scripts share (torch-free at import, so bench_memory stays small): the paths, the
argument parser, the command line a result records, timing and peak-RSS measurement, JSON output,
docs/BENCHMARKS.md's generated tables (each benchmark owns the block between its two markers,
`<!-- NAME:begin -->` ... `<!-- NAME:end -->`, and rewrites only that), and the fake-quantized KV
evaluation's inputs and calibrated candidates (kvconvert.eval.kv_quant)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOC = DOCS / "BENCHMARKS.md"


def parser(doc: str) -> argparse.ArgumentParser:
    """The script's argument parser; --help prints its docstring as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_corpora(specs: list[str] | None, windows: int) -> dict[str, int]:
    """--corpus values -> {corpus: windows}: "essays" or "FILE:16" (window count after the last colon)."""
    corpora = {}
    for spec in specs or ["essays"]:
        name, _, n = spec.rpartition(":")
        corpora.update({name: int(n)} if n.isdigit() else {spec: windows})
    return corpora


def command() -> str:
    """This run's command line as the docs show it: `python scripts/NAME.py ARGS`."""
    return " ".join([f"python scripts/{Path(sys.argv[0]).name}", *sys.argv[1:]])


@contextmanager
def stopwatch():
    """Yields a dict that gets the block's wall `seconds` and this process's `cpu_seconds` (every thread)."""
    times: dict = {}
    t0, c0 = time.time(), time.process_time()
    yield times
    times.update(seconds=round(time.time() - t0, 1), cpu_seconds=round(time.process_time() - c0, 1))


def run_child(cmd: list[str], log: Path, threads: int | None = None) -> dict:
    """Run cmd with output to log; its own peak RSS (ru_maxrss, KiB on Linux) and wall time."""
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    t0 = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    row = {"command": " ".join(str(c) for c in cmd), "seconds": round(time.time() - t0, 1),
           "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2), "rc": proc.returncode}
    if proc.returncode != 0:
        row["error_tail"] = log.read_text()[-1500:]
    return row


def write_text(path: str | Path, text: str) -> None:
    """Write atomically (a temp file beside it, then a rename), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json(path: str | Path, payload: dict, indent: int = 2) -> None:
    """Write the results as JSON, atomically (write_text)."""
    write_text(path, json.dumps(payload, indent=indent) + "\n")


def write_block(name: str, body: str, doc: Path = DOC) -> None:
    """Replace the text between NAME's markers with `body` (markers appended at the end when missing)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = doc.read_text()
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    write_text(doc, text)


def quant_eval_inputs(src: str, windows: int, window_len: int = 1024):
    """(source folder, its tokenizer, `windows` x `window_len` essay tokens (kvconvert.data.eval_windows),
    the fp32 reference model): what kvconvert.eval.kv_quant scores fake-quantized KV caches against."""
    from transformers import AutoTokenizer

    from kvconvert.data import eval_windows
    from kvconvert.quant.capture import load_hf_model
    from kvconvert.sources import resolve_source

    path = resolve_source(src)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return path, tokenizer, eval_windows(tokenizer, windows, window_len), load_hf_model(path)


def calibrated_candidate(src: str | Path, options, out: Path) -> tuple[dict, tuple]:
    """The real `kvconvert calibrate` path (kvconvert.quant.run) from src into out, with `options`
    (CalibrateOptions): (its report, (model, fake-quant cache hook), a kvconvert.eval.kv_quant
    candidate). The model is always out's: calibrate folds its scales into the weights by powers of
    two (kvconvert.quant.fold) even when it rotates nothing, so src's weights with out's scales
    would quantize at the wrong scale."""
    from kvconvert.quant.capture import load_hf_model
    from kvconvert.quant.hooks import fake_quant_hook
    from kvconvert.quant.layout import checkpoint_kv_layout
    from kvconvert.quant.run import CalibrateJob, run_calibrate
    from kvconvert.quant.scales import read_kv_scales

    report = run_calibrate(CalibrateJob(src=str(src), options=options, out=out, overwrite=True),
                           echo=lambda msg: None)["report"]
    return report, (load_hf_model(out), fake_quant_hook(checkpoint_kv_layout(out), read_kv_scales(out)))
