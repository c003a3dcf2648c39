"""The KV-format registry (kvconvert.kvformat): byte counts, scale conventions, and that the
docs and the engine names agree with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import KV_FORMATS, kv_format, markdown_table
from kvconvert.targets import TARGETS


def test_format_bytes_per_value():
    expected = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e5m2": 1, "int8": 1, "nvfp4": 0.5 + 1 / 16,
                "int4": 0.5 + 2 / 32}
    assert {n: f.bytes_per_value for n, f in KV_FORMATS.items()} == expected


def test_vector_bytes_counts_a_partial_group_scale():
    nvfp4 = kv_format("nvfp4")
    assert nvfp4.vector_bytes(16) == 8 + 1
    assert nvfp4.vector_bytes(24) == 12 + 2  # second block half full still needs its scale
    assert nvfp4.vector_bytes(576) == 288 + 36
    assert kv_format("int4").vector_bytes(64) == 32 + 2 * 2


def test_mla_rope_tail_stays_16_bit_only_under_4_bit_formats():
    assert kv_format("nvfp4").vector_bytes(576, rope_tail=64) == 256 + 32 + 128
    assert kv_format("fp8").vector_bytes(576, rope_tail=64) == 576
    assert kv_format("fp32").vector_bytes(576, rope_tail=64) == 4 * 576


def test_unknown_kv_dtype_lists_the_known_ones():
    with pytest.raises(KVConvertError, match="nvfp4"):
        kv_format("fp6")
    assert kv_format("FP8_E4M3") is kv_format("fp8")


@pytest.mark.parametrize("name", [n for n, f in KV_FORMATS.items() if f.torch_dtype and f.quantized])
def test_fp8_scale_divisor_is_the_torch_dtype_max(name):
    fmt = kv_format(name)
    assert fmt.amax_divisor == torch.finfo(getattr(torch, fmt.torch_dtype)).max
    assert fmt.scale_from_amax(fmt.amax_divisor) == 1.0


def test_engines_are_target_names():
    assert {e for f in KV_FORMATS.values() for e in f.engines} <= set(TARGETS)


def test_docs_table_is_the_registry():
    docs = (Path(__file__).parents[1] / "docs" / "formats.md").read_text()
    assert markdown_table() in docs, "docs/formats.md's registry table is stale: paste kvformat.markdown_table()"
