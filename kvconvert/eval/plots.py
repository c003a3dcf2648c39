"""PNG charts of a report (matplotlib, Agg backend, no display needed).

- niah_candidate.png / niah_delta.png: the classic needle-in-a-haystack heatmap (depth rows x
  length columns) of the candidate's score and of candidate - source.
- passkey_candidate.png: the same grid for passkey accuracy.
- longbench_tasks.png: per-task LongBench scores, source vs candidate bars.
"""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _grid(records: list[dict], role: str | None) -> tuple[list[int], list[float], np.ndarray]:
    """lengths, depths, [depths, lengths] mean score x 100 (role None = candidate - source)."""
    lengths = sorted({r["meta"]["length"] for r in records})
    depths = sorted({r["meta"]["depth"] for r in records})
    score = (lambda r: r["candidate"]["score"] - r["source"]["score"]) if role is None else (lambda r: r[role]["score"])
    grid = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
        for j, length in enumerate(lengths):
            cell = [score(r) for r in records if r["meta"]["depth"] == d and r["meta"]["length"] == length]
            if cell:
                grid[i, j] = 100 * np.mean(cell)
    return lengths, depths, grid


def _save(fig, path: Path) -> Path:
    """The chart rendered in memory, then written whole (a full disk: one line, no half PNG)."""
    from kvconvert.checkpoint import atomic_write_bytes

    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=110, format="png")
    plt.close(fig)
    atomic_write_bytes(path, png.getvalue())
    return path


def _heatmap(records: list[dict], role: str | None, title: str, path: Path) -> Path:
    lengths, depths, grid = _grid(records, role)
    fig, ax = plt.subplots(figsize=(max(4.5, 2.4 + 0.9 * len(lengths)), max(3.0, 1.4 + 0.45 * len(depths))))
    if role is None:
        limit = max(10.0, float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 10.0)
        image = ax.imshow(grid, cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
    else:
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="score (%)" if role else "candidate - source (pp)")
    return _save(fig, path)


def _longbench_bars(report: dict, path: Path) -> Path | None:
    tasks = [(k.split("/", 1)[1], m) for k, m in report["metrics"].items() if k.startswith("longbench/")]
    if not tasks:
        return None
    x = np.arange(len(tasks))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(tasks) + 2), 3.6))
    ax.bar(x - 0.2, [m["source"] for _, m in tasks], 0.4, label="source")
    ax.bar(x + 0.2, [m["candidate"] for _, m in tasks], 0.4, label="candidate")
    ax.set_xticks(x, [f"{t}\n(n={m['n']})" for t, m in tasks], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("LongBench score")
    avg = report["metrics"]["longbench_avg"]
    ax.set_title(f"LongBench-mini: source {avg['source']:.2f}, candidate {avg['candidate']:.2f}", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_plots(report: dict, out: Path) -> list[Path]:
    out = Path(out)
    written = []
    niah = report["samples"].get("niah")
    if niah:
        written.append(_heatmap(niah, "candidate", "NIAH (essays): candidate score", out / "niah_candidate.png"))
        written.append(_heatmap(niah, None, "NIAH: candidate - source", out / "niah_delta.png"))
    passkey = report["samples"].get("passkey")
    if passkey:
        written.append(_heatmap(passkey, "candidate", "passkey: candidate accuracy", out / "passkey_candidate.png"))
    bars = _longbench_bars(report, out / "longbench_tasks.png")
    if bars is not None:
        written.append(bars)
    return written
