"""scripts/bench_frontier.py --add: which earlier points a run replaces. A healed checkpoint replaces only
the points it measured before ("healed by NAME"), never another checkpoint of the same stage, such as a
second heal seed whose name extends the first's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_bench_frontier():
    sys.path.insert(0, str(SCRIPTS))  # its bench_common import
    spec = importlib.util.spec_from_file_location("bench_frontier", SCRIPTS / "bench_frontier.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def healed_point(name: str, calib: str = ", calibrate defaults on 16384 tokens") -> dict:
    """A point as measure_checkpoint writes it: the protocol, then the healed note, then the calibration."""
    note = load_bench_frontier().healed_note(name)
    return {"rank": 224, "rope_dim": 64, "stage": "healed CPU 365K", "protocol": f"essays 32 x 1024; {note}{calib}"}


def test_a_healed_group_replaces_only_its_own_points():
    remeasured_by = load_bench_frontier().remeasured_by
    seed3 = (224, 64, "healed CPU 365K", "run-long-3-seed3")
    assert remeasured_by(healed_point("run-long-3-seed3"), seed3)
    assert remeasured_by(healed_point("run-long-3-seed3", calib=""), seed3)  # the bf16 row has no calibration
    assert not remeasured_by(healed_point("run-long-3"), seed3)
    assert not remeasured_by(healed_point("run-long-3-seed3"), (224, 64, "healed CPU 365K", "run-long-3"))
    assert not remeasured_by(healed_point("run-long-3-seed3"), (224, 64, "healed CPU", "run-long-3-seed3"))


def test_a_one_shot_group_replaces_every_point_of_its_shape_and_stage():
    remeasured_by = load_bench_frontier().remeasured_by
    one_shot = {"rank": 112, "rope_dim": 32, "stage": "one-shot", "protocol": "essays 32 x 1024; conversion 8192 tokens"}
    assert remeasured_by(one_shot, (112, 32, "one-shot", None))
    assert not remeasured_by(one_shot, (96, 32, "one-shot", None))
