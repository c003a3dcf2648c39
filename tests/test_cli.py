"""The `kvconvert` entry point: command table, exit codes, one-line errors, --debug, fetch, import-gguf."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvconvert.commands.main import cli


def _kvconvert(*args, timeout=120):
    """Run the real console entry point in a fresh process."""
    return _run_code("import sys; from kvconvert.commands.main import main; main(sys.argv[1:])", *args, timeout=timeout)


def _run_code(code, *args, timeout=60):
    """`python -c code args...` in a fresh process, output captured."""
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


# A signal that lands inside C code (torch building a tensor for safetensors) can come out as an
# ordinary error: CI saw SIGTERM become "cannot read tensor ... (could not determine the shape of
# object type 'torch.storage.UntypedStorage')", exit 2. The stand-in below swallows the signal's
# exception the same way and raises the error that C code left behind.
_SWALLOWING_COMMAND = """
import os, signal, sys, time
import kvconvert.commands.main as entry
from kvconvert.errors import CheckpointError

def run_and_lose_the_interrupt(*args, **kwargs):
    try:
        os.kill(os.getpid(), signal.SIG{sig})
        time.sleep(5)
    except BaseException:
        pass
    raise {error}("model.safetensors: cannot read tensor 'w' (could not determine the shape)")

entry.cli.main = run_and_lose_the_interrupt
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal: a background job inherits SIG_IGN
signal.signal(signal.SIGTERM, signal.SIG_DFL)
entry.main([])
"""


@pytest.mark.parametrize("sig", ["TERM", "INT"])
@pytest.mark.parametrize("error", ["CheckpointError", "ValueError"])
def test_signal_turned_into_another_error_still_reports_the_interrupt(sig, error):
    code = _SWALLOWING_COMMAND.format(sig=sig, error=error)
    result = _run_code(code)
    assert result.returncode == 130, result.stderr
    assert result.stderr == "Interrupted: nothing was left half-written at the output path.\n"


def test_the_same_error_without_a_signal_is_still_the_error():
    code = _SWALLOWING_COMMAND.format(sig="TERM", error="CheckpointError").replace(
        "os.kill(os.getpid(), signal.SIGTERM)", "pass")
    result = _run_code(code)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "cannot read tensor 'w'" in result.stderr


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


def test_every_commands_help_is_torch_free():
    """`kvconvert CMD --help` loads the command's module and its options models, never torch (the
    commands import the library lazily; the runtime's LLM loads on first use)."""
    code = ("import sys\nfrom click.testing import CliRunner\nfrom kvconvert.commands.main import LAZY_COMMANDS, cli\n"
            "for name in LAZY_COMMANDS:\n"
            "    result = CliRunner().invoke(cli, [name, '--help'])\n"
            "    assert result.exit_code == 0 and '--help' in result.output, (name, result.output)\n"
            "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
            "assert not heavy, f'--help imported {heavy}'\n")
    result = _run_code(code)
    assert result.returncode == 0, result.stderr
