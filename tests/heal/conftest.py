"""Fixtures for this folder's tests; the builders they use live in heal_cases.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))  # eval_fixtures, for heal_cases
from heal_cases import build_llama, convert_tiny  # noqa: E402


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """~40K tokens of the built-in corpus as a local .txt (tokenizing all of it is slow)."""
    from kvconvert.data import pydoc_corpus

    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(pydoc_corpus()[200_000:300_000])
    return path


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> Path:
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead on a shared CPU
    return build_llama(tmp_path_factory.mktemp("teacher") / "llama")


@pytest.fixture(scope="session")
def tiny_student(tiny_teacher, text_file, tmp_path_factory) -> Path:
    """rank 8 + rope 8 (of 2 kv heads x 16 dims): a lossy conversion that healing can improve."""
    return convert_tiny(tiny_teacher, tmp_path_factory.mktemp("student") / "mla", text_file)
