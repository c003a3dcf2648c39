"""Fixtures for this folder's tests; the builders they use live in runtime_cases.py."""

from __future__ import annotations

import pytest
from runtime_cases import build


@pytest.fixture(scope="session")
def llama_gqa(tmp_path_factory):
    return build(tmp_path_factory.mktemp("llama_gqa"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def deepseek_mla(tmp_path_factory):
    return build(tmp_path_factory.mktemp("deepseek_mla"), "deepseek_v3")


@pytest.fixture(params=["llama", "deepseek"])
def tiny_model(request, llama_gqa, deepseek_mla):
    return llama_gqa if request.param == "llama" else deepseek_mla


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models: one torch thread (tests/conftest.py)."""
