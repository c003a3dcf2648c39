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
