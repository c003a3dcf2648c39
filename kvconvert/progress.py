"""Progress lines with elapsed time and an ETA, for the phases that count their work (layers, windows,
candidates) and print one line per step instead of a bar (pipeline logs stay readable when captured).

    step = counted("  calibrated layer", echo)   # echo: print-like
    step(3, 30)                                  # "  calibrated layer 3/30 (12 s, ETA 1 min 48 s)"

The ETA assumes the steps left cost what the steps done cost on average; it is a guide on a
machine shared with other work, not a promise.
"""

from __future__ import annotations

import time


def clock(seconds: float) -> str:
    """42 s, 3 min 05 s."""
    seconds = int(round(seconds))
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


def eta_text(started: float, done: int, total: int) -> str:
    """"12 s, ETA 40 s" after `done` of `total` steps begun at `started` (time.time()); no ETA once done."""
    elapsed = time.time() - started
    if done <= 0 or done >= total:
        return clock(elapsed)
    return f"{clock(elapsed)}, ETA {clock(elapsed / done * (total - done))}"


def counted(label: str, echo, started: float | None = None):
    """A progress callback (done, total) -> echo(f"{label} {done}/{total} ({elapsed}, ETA ...)"); the clock
    starts now unless `started` is given."""
    t0 = time.time() if started is None else started

    def step(done: int, total: int) -> None:
        echo(f"{label} {done}/{total} ({eta_text(t0, done, total)})")

    return step
