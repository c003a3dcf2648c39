"""Faults around the stock engines and the GGUF export, through the real CLI in a subprocess: a broken llama.cpp
install, disks too small or read-only for an export, checkpoints GGUF cannot hold, mistyped paths, and reports
that do not record what was asked. Each is one `error: ...` line (exit 2) before any work, or a correct result."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_faults import ENV, ROOT, kvconvert, refused


def kvconvert_in(cwd: Path, *args, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """test_faults.kvconvert run in the folder `cwd` (relative paths) and/or with another environment."""
    return subprocess.run([sys.executable, "-m", "kvconvert.cli", *map(str, args)], capture_output=True, text=True,
                          env=env or ENV, cwd=cwd, timeout=timeout)


def broken_llama_cpp(folder: Path) -> Path:
    """A copy of the installed llama-cpp-python's Python files without its compiled llama.cpp (as a partial
    install or a wiped build leaves it): `import llama_cpp` finds the package, loading it fails."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        pytest.skip("llama-cpp-python is not installed (bash scripts/setup_llamacpp.sh)")
    package = folder / "llama_cpp"
    shutil.copytree(Path(spec.origin).parent, package, ignore=shutil.ignore_patterns("lib", "*.so*", "__pycache__"))
    return folder


def test_validate_probes_a_broken_llama_cpp_before_the_suite(faults, tmp_path):
    broken = broken_llama_cpp(tmp_path / "site")
    out = tmp_path / "report"
    started = time.time()
    done = kvconvert_in(ROOT, "validate", "--source", faults["base"], "--candidate", faults["base"], "--engine",
                        "llamacpp", "--suite", "smoke", "--no-progress", "--out", out,
                        env=dict(ENV, PYTHONPATH=str(broken)))
    line = refused(done, out, "llama-cpp-python in", "is installed but does not load", "setup_llamacpp.sh")
    assert "log " not in line  # no log file named, let alone a deleted one
    assert "llama.cpp perplexity" not in done.stderr and "Suite" not in done.stderr
    assert time.time() - started < 60, "refused only after work"
