"""Faults in the training and calibration text, through the real CLI in a subprocess: each is one
`error: ...` line (exit 2) that names the file (and line) and says what to do, before any work, and
nothing is left at the output path. The readers are kvconvert.text_sources' (one for calibrate,
heal and the streamed distillation)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_faults import ENV, ROOT, TINY_CAL, kvconvert, refused

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "heal"))
from heal_cases import build_llama, convert_tiny  # noqa: E402

LAYERWISE = ["--recipe", "layerwise", "--layerwise-tokens", "256", "--layerwise-window", "64", "--layerwise-steps",
             "1", "--no-progress", "--threads", "1"]
LINES = [json.dumps({"text": f"the function returns a value number {i} of the list"}) + "\n" for i in range(200)]
ROWS = "".join(LINES)

# name -> (file name, bytes, what the one-line error says; {path} is the file)
FILES = {
    "broken-line": ("broken.jsonl", ("".join(LINES[:3]) + '{"text": "no closing quote}\n' + ROWS).encode(),
                    ("{path}:4: not valid JSON (Invalid control character at column 28)", "fix or delete that line")),
    "numbers": ("numbers.jsonl", b"5\n6\n7\n",
                ("{path}:1: a row is 5 (int), not a JSON object", "with the text in a 'text' field")),
    "latin-1": ("latin1.jsonl", "".join(LINES[:2]).encode() + json.dumps({"text": "caf\u00e9"}, ensure_ascii=False)
                .encode("latin-1") + b"\n", ("{path}:3: not UTF-8 text (byte 0xe9", "iconv -f latin1 -t utf-8")),
}


def data_file(tmp_path: Path, case: str) -> tuple[Path, tuple[str, ...]]:
    name, content, expected = FILES[case]
    path = tmp_path / name
    path.write_bytes(content)
    return path, tuple(e.format(path=path) for e in expected)


@pytest.fixture(scope="module")
def heal_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama teacher and its MLA conversion (tests/heal's builders)."""
    from kvconvert.data import pydoc_corpus

    root = tmp_path_factory.mktemp("pair")
    text = root / "calib.txt"
    text.write_text(pydoc_corpus()[200_000:260_000])
    teacher = build_llama(root / "teacher")
    return convert_tiny(teacher, root / "student", text), teacher


def heal_args(pair, data, out) -> list:
    student, teacher = pair
    return ["heal", "--student", student, "--teacher", teacher, *LAYERWISE, "--layerwise-data", data, "--out", out]


@pytest.mark.parametrize("case", FILES)
def test_calibrate_refuses_a_broken_data_file(faults, tmp_path, case):
    path, expected = data_file(tmp_path, case)
    out = tmp_path / "out"
    refused(kvconvert("calibrate", "--src", faults["base"], *TINY_CAL, "--calib-data", path, "--out", out), out,
            *expected)


@pytest.mark.parametrize("case", FILES)
def test_heal_refuses_a_broken_data_file(heal_pair, tmp_path, case):
    path, expected = data_file(tmp_path, case)
    out = tmp_path / "out"
    refused(kvconvert(*heal_args(heal_pair, path, out)), out, *expected)


def test_a_broken_shard_in_a_folder_names_the_shard(heal_pair, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(LINES[:4]))  # too few for the layer-wise windows, so b is read
    (folder / "b.jsonl").write_bytes(FILES["broken-line"][1])
    out = tmp_path / "out"
    refused(kvconvert(*heal_args(heal_pair, folder, out)), out, f"{folder / 'b.jsonl'}:4: not valid JSON")


@pytest.mark.parametrize("command", ["calibrate", "heal"])
def test_a_missing_data_file_is_named_not_taken_for_a_datasets_id(faults, heal_pair, tmp_path, command):
    missing, out = tmp_path / "data" / "heal-train.jsonl", tmp_path / "out"
    args = (["calibrate", "--src", faults["base"], *TINY_CAL, "--calib-data", missing, "--out", out]
            if command == "calibrate" else heal_args(heal_pair, missing, out))
    line = refused(kvconvert(*args), out, f"{missing}: no such file or folder")
    assert "pip install" not in line
    # a relative path with a folder, as the 7B recipes' comments suggest, is a path too
    line = refused(kvconvert(*[a if a != missing else "data/heal-train.jsonl" for a in args]), out,
                   "data/heal-train.jsonl: no such file or folder")


def test_a_parquet_without_pyarrow_names_the_extra(faults, tmp_path):
    """pyarrow made unimportable in the subprocess (as on an install without the datasets extra)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path, out = tmp_path / "train.parquet", tmp_path / "out"
    pq.write_table(pa.table({"text": [f"row {i} of the table" for i in range(300)]}), path)
    blocked = ("import sys; sys.modules['pyarrow'] = sys.modules['pyarrow.parquet'] = None; "
               "from kvconvert.commands.main import main; main()")
    args = ["calibrate", "--src", faults["base"], *TINY_CAL, "--calib-data", path, "--out", out]
    done = subprocess.run([sys.executable, "-c", blocked, *map(str, args)], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=300)
    refused(done, out, f"{path}: reading .parquet needs pyarrow", "pip install 'kvconvert[datasets]'")
