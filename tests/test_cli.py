"""The `kvconvert` entry point: command table, exit codes, one-line errors, --debug, fetch, import-gguf."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvconvert.cli import cli


def _kvconvert(*args, timeout=120):
    """Run the real console entry point in a fresh process."""
    code = "import sys; from kvconvert.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_foundation_commands():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in ("inspect", "budget", "fetch", "import-gguf"):
        assert name in result.output


def test_user_error_is_exit_2_one_line_no_traceback(tmp_path):
    result = _kvconvert("inspect", str(tmp_path))  # a folder without config.json
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "config.json" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_debug_shows_the_traceback(tmp_path):
    result = _kvconvert("--debug", "inspect", str(tmp_path))
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "CheckpointError" in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["budget"], "--model"),  # click's usage error (--model missing) keeps click's exit code
    (["fetch", "gpt-5"], "smollm2-135m"),  # an unknown name lists the built-in models
])
def test_exit_code_2_with_the_message(argv, message, run_main):
    code, err = run_main(argv)
    assert code == 2 and message in err


@pytest.mark.slow
def test_fetch_prints_the_cached_folder(smollm2_path):
    result = CliRunner().invoke(cli, ["fetch"])
    assert result.exit_code == 0 and result.output.strip() == str(smollm2_path)


def test_import_gguf_bad_file_is_one_line(tmp_path, run_main):
    (tmp_path / "model.gguf").write_bytes(b"not a gguf at all")
    code, err = run_main(["import-gguf", str(tmp_path / "model.gguf"), "--out", str(tmp_path / "out")])
    assert code == 2 and "model.gguf" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
