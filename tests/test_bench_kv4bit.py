"""scripts/bench_kv4bit.py's bookkeeping: the gate's three verdicts on window records, the byte count of a K/V
pair row, and --rows keeping the JSON's other rows (a rerun replaces only the rows it measured)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_bench():
    sys.path.insert(0, str(SCRIPTS))  # its bench_common import
    spec = importlib.util.spec_from_file_location("bench_kv4bit", SCRIPTS / "bench_kv4bit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_kv4bit"] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def records(kl_per_token: float, nll_ratio: float, n: int = 8) -> list[dict]:
    """n windows of 1000 predictions: the candidate's NLL nll_ratio x the source's, KL kl_per_token a token,
    with a little spread across windows so the bootstrap has an interval."""
    return [{"source_nll": 3000.0 + 10 * w, "candidate_nll": (3000.0 + 10 * w) * nll_ratio * (1 + 0.002 * (w % 3 - 1)),
             "kl": 1000 * kl_per_token * (1 + 0.05 * (w % 3 - 1)), "n_tokens": 1000} for w in range(n)]


def test_the_gate_verdicts_are_the_gates_own():
    bench = load_bench()
    clear = bench.gate_verdict(records(0.01, 1.01))
    assert clear["kl_mean"]["verdict"] == "PASS" and clear["verdict"] == "PASS"
    past = bench.gate_verdict(records(0.2, 1.2))
    assert past["kl_mean"]["verdict"] == "FAIL" and past["verdict"] == "FAIL"
    straddling = bench.gate_verdict(records(0.05, 1.01))
    assert straddling["kl_mean"]["verdict"] == "INCONCLUSIVE" and straddling["verdict"] == "INCONCLUSIVE"


def test_a_pair_row_counts_both_halves():
    from kvconvert.kvformat import kv_pair
    from kvconvert.kvmath import GQA, KVShape, kv_bytes_per_token

    shape = KVShape(GQA, 30, 9, num_kv_heads=3, head_dim=64)
    pair = kv_bytes_per_token(shape, "q5_0/iq4_nl")
    assert 2 * pair == kv_bytes_per_token(shape, "q5_0") + kv_bytes_per_token(shape, "iq4_nl")
    assert kv_pair(load_bench().rows_for("mla")[15].kv_dtype).ggml_types == ("q5_0", "iq4_nl")


def test_rows_keeps_the_other_rows_and_replaces_its_own(tmp_path):
    bench = load_bench()
    old_row = {"name": "q8_0", "model": "source", "kv_dtype": "q8_0", "gate": {}}
    remeasured = {"name": "q4_0", "model": "source", "kv_dtype": "q4_0", "gate": {"old": True}}
    path = tmp_path / "kv4bit.json"
    path.write_text(json.dumps({"windows": 8, "window_len": 1024, "rows": [remeasured, old_row], "command": "old",
                                "device": "d", "commit": "c", "date": "x"}))
    new = {**remeasured, "gate": {"old": False}, "measured": {"command": "new"}}
    rows = bench.merged([new], path, 8, 1024)
    assert [r["name"] for r in rows] == ["q8_0", "q4_0"]  # the table's order
    assert rows[0]["measured"]["command"] == "old" and rows[0]["heal_tokens"] == 0
    assert rows[1]["gate"] == {"old": False}
    assert bench.merged([new], path, 32, 1024) == [new]  # other windows: not merged
