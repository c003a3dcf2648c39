"""Fixtures for this folder's tests; the builders they use live in runtime_cases.py."""

from __future__ import annotations

import pytest
import torch
from runtime_cases import build_deepseek, build_llama


@pytest.fixture(scope="session")
def llama_gqa(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llama_gqa"))


@pytest.fixture(scope="session")
def deepseek_mla(tmp_path_factory):
    return build_deepseek(tmp_path_factory.mktemp("deepseek_mla"))


@pytest.fixture(params=["llama", "deepseek"])
def tiny_model(request, llama_gqa, deepseek_mla):
    return llama_gqa if request.param == "llama" else deepseek_mla


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models are all thread-sync overhead: one intra-op thread is many times faster on a busy
    2-core machine. Restored afterwards so other test directories keep their setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
