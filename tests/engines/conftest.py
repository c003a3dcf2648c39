"""Fixtures for the stock-vLLM engine tests (marker `vllm`).

They need ./.venv-vllm (bash scripts/setup_vllm.sh) or $KVCONVERT_VLLM_PYTHON. Without it they
skip with the reason, unless KVCONVERT_REQUIRE_VLLM=1 (CI sets it), which turns the skip into a
failure so a broken install cannot pass as skipped tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The tiny-Llama builder is shared with the conversion tests (one source of truth).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mla"))

REQUIRE_ENV = "KVCONVERT_REQUIRE_VLLM"


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    from kvconvert.engines.vllm import vllm_python
    from kvconvert.errors import KVConvertError

    try:
        return vllm_python()
    except KVConvertError as reason:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 and stock vLLM is not available: {reason}")
        pytest.skip(f"stock vLLM not set up: {reason}")


@pytest.fixture(scope="session")
def vllm_fp8(vllm_python) -> Path:
    """vLLM's python, where its CPU build can hold an FP8 KV cache: x86 with AVX-512 or AMX
    (vllm/v1/attention/backends/cpu_attn.py `_get_attn_isa`: "FP8 KV cache on CPU requires x86 with
    AVX-512 or AMX"). Elsewhere the FP8 tests skip with that reason, KVCONVERT_REQUIRE_VLLM or not:
    the hardware, not the install, is missing."""
    import torch

    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("this CPU has neither AVX-512 nor AMX: vLLM's CPU build has no FP8 KV cache here")
    return vllm_python


REQUIRE_LLAMACPP_ENV = "KVCONVERT_REQUIRE_LLAMACPP"


@pytest.fixture(scope="session")
def llamacpp_ready() -> None:
    """llama-cpp-python importable in this venv (bash scripts/setup_llamacpp.sh); else the llama.cpp
    tests skip with the reason, or fail under KVCONVERT_REQUIRE_LLAMACPP=1 (scripts/test.sh, CI)."""
    from kvconvert.engines.llamacpp import check_installed
    from kvconvert.errors import KVConvertError

    try:
        check_installed()
    except KVConvertError as reason:
        if os.environ.get(REQUIRE_LLAMACPP_ENV) == "1":
            pytest.fail(f"{REQUIRE_LLAMACPP_ENV}=1 and llama.cpp is not available: {reason}")
        pytest.skip(f"llama.cpp not set up: {reason}")
