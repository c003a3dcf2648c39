"""scripts/bench_common.write_bench_table: the current tables of docs/BENCHMARKS.md, each between
`<!-- bench:STAGE -->` and `<!-- /bench:STAGE -->`, are rendered from a bench JSON's "bench_rows". Run on a temp
copy of the real doc (no benchmark runs): a rerun's row replaces the row of the same measure, other rows of the
stage stay, the text around the markers is unchanged."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # bench_common is a script module, not a package

import bench_common  # noqa: E402

INFO = {"device": "AMD EPYC", "commit": "abc1234", "date": "2026-12-01"}


@pytest.fixture
def doc(tmp_path) -> Path:
    copy = tmp_path / "BENCHMARKS.md"
    shutil.copy(bench_common.DOC, copy)
    return copy


def section(text: str, name: str) -> str:
    return text.split(f"<!-- bench:{name} -->", 1)[1].split(f"<!-- /bench:{name} -->", 1)[0]


def test_the_doc_has_every_stage_table_and_the_kv4bit_section():
    text = bench_common.DOC.read_text()
    for stage in ("conversion", "healing", "calibration", "validation", "runtime", "memory"):
        rows = bench_common.parse_bench_table(section(text, stage))
        assert rows, stage
        assert all(row["value"] != "-" and row["device"] and row["date"] for row in rows), stage
    section(text, "kv4bit")  # its markers exist (the table between them is filled by its own measurements)


def test_a_bench_json_refreshes_its_row_and_keeps_the_others(doc, tmp_path):
    before = doc.read_text()
    old = bench_common.parse_bench_table(section(before, "calibration"))
    measure = old[0]["measure"]
    payload = {"bench_rows": {"calibration": bench_common.bench_rows(
        [(measure, "ppl +0.40% vs an unquantized cache (24.784), token KL 0.00580", "[+0.1%, +0.7%]"),
         ("a new config | with a pipe", "KL 0.1")], INFO, "python scripts/bench_calibrate.py --threads 2")}}
    json_path = tmp_path / "bench_calibrate.json"
    json_path.write_text(json.dumps(payload))

    bench_common.write_bench_table("calibration", json_path, doc)

    after = doc.read_text()
    rows = bench_common.parse_bench_table(section(after, "calibration"))
    assert [r["measure"] for r in rows] == [r["measure"] for r in old] + ["a new config | with a pipe"]
    assert rows[0] == {"measure": measure, "value": "ppl +0.40% vs an unquantized cache (24.784), token KL 0.00580",
                       "interval": "[+0.1%, +0.7%]", **INFO, "command": "python scripts/bench_calibrate.py --threads 2"}
    assert rows[1:-1] == old[1:]
    assert rows[-1]["interval"] == "-" and rows[-1]["value"] == "KL 0.1"
    # only the calibration section changed
    assert after.split("<!-- bench:calibration -->")[0] == before.split("<!-- bench:calibration -->")[0]
    assert after.split("<!-- /bench:calibration -->")[1] == before.split("<!-- /bench:calibration -->")[1]
    assert "| Measure | Value | Interval | Device | Commit | Date | Command |" in section(after, "calibration")
    assert "a new config \\| with a pipe" in section(after, "calibration")


def test_an_empty_section_gets_a_table_and_a_missing_one_is_appended(doc):
    text = doc.read_text()
    doc.write_text(text.replace(section(text, "kv4bit"), "\n"))  # an empty section, whatever the doc holds
    payload = {"bench_rows": {"kv4bit": bench_common.bench_rows([("SmolLM2-135M nvfp4 on runtime", "KL 0.07")], INFO, "x"),
                              "newstage": bench_common.bench_rows([("m", "v")], INFO, "y")}}
    bench_common.write_bench_table("kv4bit", payload, doc)
    bench_common.write_bench_table("newstage", payload, doc)
    text = doc.read_text()
    assert [r["value"] for r in bench_common.parse_bench_table(section(text, "kv4bit"))] == ["KL 0.07"]
    assert text.rstrip().endswith("<!-- /bench:newstage -->")
    assert bench_common.parse_bench_table(section(text, "newstage"))[0]["command"] == "y"


def test_only_results_written_to_docs_are_published(doc, tmp_path):
    payload = {"bench_rows": {"memory": bench_common.bench_rows([("m", "v")], INFO, "z")}}
    bench_common.publish_rows(payload, tmp_path / "bench_memory.json", doc)  # a smoke run's or a test's JSON
    assert doc.read_text() == bench_common.DOC.read_text()
    bench_common.publish_rows(payload, bench_common.DOCS / "bench_memory.json", doc)  # where the published JSONs live
    assert bench_common.parse_bench_table(section(doc.read_text(), "memory"))[-1]["measure"] == "m"


def test_run_info_names_this_machine():
    info = bench_common.run_info()
    assert info["device"] and info["commit"] and len(info["date"]) == 10


def test_recorded_commands_name_scratch_folders_relatively():
    """A run's command line goes into the docs with its scratch folder as WORK, other outside files as OUT/<name> and
    the checkout's files relative to it; no command in docs/BENCHMARKS.md names a machine's absolute folder."""
    import re

    argv = ["/x/scripts/bench_heal.py", "--work", "/tmp/run7", "--healed", "a=/tmp/run7/a/healed", "--corpus",
            "/data/lb/gov.jsonl:16", "--json", str(ROOT / "docs" / "bench_heal.json"), "--windows", "8"]
    assert bench_common.command(argv) == ("python scripts/bench_heal.py --work WORK --healed a=WORK/a/healed "
                                          "--corpus OUT/gov.jsonl:16 --json docs/bench_heal.json --windows 8")
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    commands = [c for c in re.findall(r"`([^`]*)`", text) if "python scripts/" in c or "git clone" in c]
    assert commands
    absolute = [c for c in commands if re.search(r"(?<![\w.~])/(tmp|work|root|home|mnt)/", c)]
    assert not absolute, absolute[:3]
