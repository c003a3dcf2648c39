"""Fixtures for the validate/gate tests: a tiny trained BPE tokenizer and tiny random models.

The tokenizer is a real byte-level BPE (512 tokens) trained in about a second on Python's pydoc
text, wrapped as a transformers fast tokenizer, so haystack building, truncation and the whole
validate pipeline run in seconds without the SmolLM2 download.
"""

from __future__ import annotations

import pytest
from eval_fixtures import save_tiny_model, train_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_tokenizer")
    train_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from kvconvert.checkpoint import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tiny_tokenizer_dir, tiny_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), len(tiny_tokenizer), seed=0,
                           tokenizer_dir=tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def calibrated_fp8(tmp_path_factory, tiny_llama):
    """The tiny Llama with FP8 KV scales from `kvconvert calibrate` (amax, 4 x 256 tokens)."""
    from kvconvert.commands.main import main

    out = tmp_path_factory.mktemp("calibrated") / "fp8"
    try:
        main(["calibrate", "--src", str(tiny_llama), "--kv-dtype", "fp8", "--observer", "amax", "--calib-tokens",
              "1024", "--window-len", "256", "--out", str(out), "--quiet", "--threads", "1"])
    except SystemExit as exc:  # the CLI exits only on errors
        assert exc.code in (0, None), f"kvconvert calibrate failed with exit code {exc.code}"
    return out


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These tests run small matmuls: one torch thread (tests/conftest.py)."""
