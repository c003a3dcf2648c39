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
