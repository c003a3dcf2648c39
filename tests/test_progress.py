"""Progress lines: elapsed time and an ETA from the steps done (kvconvert.progress)."""

import time

from kvconvert.progress import clock, counted, eta_text


def test_clock_and_eta():
    assert clock(42.4) == "42 s" and clock(185) == "3 min 05 s"
    started = time.time() - 30  # 3 of 10 steps took 30 s: 70 s left
    assert eta_text(started, 3, 10) == "30 s, ETA 1 min 10 s"
    assert eta_text(started, 10, 10) == "30 s"  # done: no ETA
    lines = []
    counted("  calibrated layer", lines.append, started)(3, 10)
    assert lines == ["  calibrated layer 3/10 (30 s, ETA 1 min 10 s)"]
