"""Fixtures for this folder's tests; the builders they use live in quant_cases.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from quant_cases import WORDS_FILE_TOKENS, make_deepseek, make_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory) -> Path:
    return make_deepseek(tmp_path_factory.mktemp("tiny_deepseek"))


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory) -> Path:
    """A small .txt of pydoc prose (about WORDS_FILE_TOKENS word tokens)."""
    from kvconvert.data import pydoc_corpus

    words = pydoc_corpus().split()[:WORDS_FILE_TOKENS]
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(" ".join(words))
    return path
