"""What the benchmark scripts share (torch-free at import, so bench_memory stays small): the paths, the
argument parser, the command line a result records, timing and peak-RSS measurement, JSON output,
docs/BENCHMARKS.md's generated tables (each benchmark owns the block between its two markers,
`<!-- NAME:begin -->` ... `<!-- NAME:end -->`, and rewrites only that; and its rows of the current
tables between `<!-- bench:STAGE -->` ... `<!-- /bench:STAGE -->`, which several benchmarks share), and
the fake-quantized KV evaluation's inputs and calibrated candidates (kvconvert.eval.kv_quant)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
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


def command(argv: list[str] | None = None) -> str:
    """This run's command line as the docs show it: `python scripts/NAME.py ARGS`, with this machine's scratch
    folders in relative names a reader can reuse (portable_args)."""
    argv = sys.argv if argv is None else argv
    return " ".join([f"python scripts/{Path(argv[0]).name}", *portable_args(argv[1:])])


WORK_FLAGS = ("--work", "--workdir", "--work-dir")  # the benchmarks' scratch folder
_ABSOLUTE = re.compile(r"(?<![\w.~])/[^\s:=,]+")  # an absolute path inside an argument (NAME=/x, /x:16, /x)


def portable_args(args: list[str], scratch: tuple[str, ...] = ()) -> list[str]:
    """Arguments with absolute paths made reusable: the scratch folder a --work / --workdir flag names (or one of
    `scratch`) becomes WORK (and a path under it WORK/...), a file of the checkout its path from the checkout's
    root, any other absolute path OUT/<its name> (a file the run wrote or read on that machine)."""
    work = [args[i + 1] for i, a in enumerate(args[:-1]) if a in WORK_FLAGS and args[i + 1].startswith("/")]
    work += sorted(scratch, key=len, reverse=True)

    def portable(match: re.Match) -> str:
        path = match.group(0)
        for folder in work:
            if path == folder or path.startswith(folder.rstrip("/") + "/"):
                return "WORK" + path[len(folder.rstrip("/")):]
        if Path(path).is_relative_to(ROOT):
            return str(Path(path).relative_to(ROOT)) or "."
        return f"OUT/{Path(path).name}"

    return [_ABSOLUTE.sub(portable, a) for a in args]


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


BENCH_COLUMNS = ("measure", "value", "interval", "device", "commit", "date", "command")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")  # a table cell boundary: a pipe not escaped as \|


def device_name(device: str = "cpu") -> str:
    """What a result was measured on: the GPU's name for a cuda device, else the CPU model name as lscpu prints
    it (its "Model name:" line; /proc/cpuinfo's "model name" where lscpu is missing)."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.lower().startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def run_info(device: str = "cpu") -> dict:
    """This run's device (device_name), commit (the checkout's short HEAD) and date (UTC), as a row records them."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "not recorded"
    return {"device": device_name(device), "commit": commit, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}


def bench_rows(results: list[tuple], info: dict | None = None, cmd: str | None = None) -> list[dict]:
    """(measure, value) or (measure, value, interval) tuples -> rows of a current table, each with this run's
    device, commit and date (run_info) and command line; a bench JSON records them per stage under
    "bench_rows" ({stage: rows}). The measure names the quantity and its setting, not the command, so a
    rerun replaces its row."""
    info = info or run_info()
    return [{"measure": r[0], "value": r[1], "interval": r[2] if len(r) > 2 and r[2] else "-", **info,
             "command": cmd or command()} for r in results]


def _cell(text) -> str:
    return str(text).replace("\n", " ").replace("|", "\\|")


def render_bench_table(rows: list[dict]) -> str:
    """The current table of a stage: one row per measure, its value, interval, device, commit, date and command."""
    lines = ["| " + " | ".join(c.capitalize() for c in BENCH_COLUMNS) + " |", "|" + "---|" * len(BENCH_COLUMNS)]
    for row in rows:
        cells = [_cell(row.get(c) or "-") for c in BENCH_COLUMNS]
        cells[-1] = f"`{cells[-1]}`" if cells[-1] != "-" else "-"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_bench_table(text: str) -> list[dict]:
    """The rows of a table render_bench_table wrote (header and separator skipped; other lines ignored)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip().replace("\\|", "|") for c in _CELL_SPLIT.split(line.strip())[1:-1]]
        if len(cells) != len(BENCH_COLUMNS) or cells[0] in ("Measure", "---"):
            continue
        row = dict(zip(BENCH_COLUMNS, cells))
        row["command"] = row["command"].strip("`")
        rows.append(row)
    return rows


def write_bench_table(name: str, source, doc: Path = DOC) -> None:
    """Refresh the current table between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in doc from a bench
    JSON (a path, or its dict) whose "bench_rows" lists rows for stage NAME (bench_rows): each replaces the row
    of the same measure or is appended; the others (other benchmarks' rows of the stage, rows measured by hand)
    stay as they are. A section without its markers is appended at the end of doc."""
    payload = json.loads(Path(source).read_text()) if isinstance(source, (str, Path)) else source
    new = (payload.get("bench_rows") or {}).get(name, [])
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = doc.read_text()
    if begin not in text or end not in text:
        text = text.rstrip() + f"\n\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    body, tail = rest.split(end, 1)
    rows = {row["measure"]: row for row in parse_bench_table(body)}
    rows.update({row["measure"]: {c: row.get(c, "-") for c in BENCH_COLUMNS} for row in new})
    table = f"{render_bench_table(list(rows.values()))}\n" if rows else ""
    write_text(doc, f"{head}{begin}\n{table}{end}{tail}")


def publish_rows(payload: dict, json_path: str | Path, doc: Path = DOC) -> None:
    """write_bench_table for every stage of payload's "bench_rows", when the JSON was written to docs/ (the
    published results); a JSON written elsewhere (a smoke run, a test's temp folder) leaves doc alone."""
    if Path(json_path).resolve().parent == DOCS.resolve():
        for name in payload.get("bench_rows") or {}:
            write_bench_table(name, payload, doc)


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


if __name__ == "__main__":
    # python scripts/bench_common.py JSON ...: refresh docs/BENCHMARKS.md's current tables from bench JSONs written
    # elsewhere (a GPU machine's $OUT), after copying them into docs/
    for path in sys.argv[1:]:
        for stage in json.loads(Path(path).read_text()).get("bench_rows") or {}:
            write_bench_table(stage, path)
