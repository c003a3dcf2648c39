import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton picks interpreter vs compiled mode at kernel import time: set it before any test imports kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_path():
    """The embedded default model (SmolLM2-135M-Instruct, fp32 safetensors), imported once."""
    from kvconvert.sources import resolve_source

    return resolve_source("smollm2-135m")


@pytest.fixture
def one_torch_thread():
    """Tiny models are all thread-sync overhead: one intra-op thread is many times faster on a busy
    2-core machine. Restored afterwards so other test directories keep their setting."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def run_main(capsys):
    """`kvconvert ARGV` in this process (kvconvert.commands.main.main): returns (exit code, stderr)."""
    from kvconvert.commands.main import main

    def run(argv) -> tuple[int, str]:
        try:
            main([str(a) for a in argv])
        except SystemExit as exc:
            return exc.code, capsys.readouterr().err
        return 0, capsys.readouterr().err
    return run
