"""The runtime's shortcuts for CPU speed compute exactly what the plain paths compute (bit for bit):
the FP8 / INT8 cache read through a table of the 256 codes, and a small 16-bit lm_head upcast once."""

from __future__ import annotations

import pytest
import torch

from kvconvert.kernels.cache_layout import dequantize_rows
from kvconvert.runtime.kv_cache import CacheSpec, Workspace, code_table_dequantize, gather, make_layer, write
from kvconvert.runtime.layers import LOGIT_CHUNK, fp32_logits, upcast_chunks


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns (NaN codes compare equal to themselves)."""
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("codes, mode", [(torch.float8_e4m3fn, "fp8"), (torch.float8_e5m2, "fp8"), (torch.int8, "int8")])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, scale", [((2, 48, 3, 64), [[0.031]]),  # GQA, one scale for the tensor
                                          ((2, 48, 3, 64), [[0.5], [0.01], [3.0]]),  # GQA, per KV head
                                          ((1, 32, 320), [0.07])])  # an MLA row, one scale
def test_code_table_is_the_per_value_dequant(codes, mode, out_dtype, shape, scale):
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).view(codes)
    scale = torch.tensor(scale)
    got = code_table_dequantize(raw, scale, out_dtype, Workspace())
    assert torch.equal(_bits(got), _bits(dequantize_rows(mode, raw, scale, out_dtype=out_dtype)))


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_gather_of_a_scaled_cache_reads_what_was_written(kv_dtype):
    """Through the paged gather: K written in fp8 / int8 with per-head scales reads back as the per-value dequant."""
    layer = make_layer(kv_dtype, 6, 4, {"k": CacheSpec((3, 8)), "v": CacheSpec((3, 8))},
                       {"k": torch.tensor([[0.02], [0.1], [0.5]]), "v": torch.tensor(0.3)})
    k, v = torch.randn(24, 3, 8) * 20, torch.randn(24, 3, 8)
    write(layer, k, v, torch.arange(24))
    tables = torch.tensor([[5, 0, 2]])
    for name in ("k", "v"):
        out = torch.empty(1, 12, 3, 8)
        gather(layer, name, tables, out, Workspace())
        values, _, scale, _ = layer.stored(name)
        expected = dequantize_rows(layer.mode, values[tables[0]].reshape(12, 3, 8), scale)
        assert torch.equal(out[0], expected)


def test_kept_fp32_lm_head_gives_the_same_logits():
    g = torch.Generator().manual_seed(1)
    head = torch.randn(LOGIT_CHUNK + 100, 32, generator=g).to(torch.bfloat16)
    hidden = torch.randn(5, 32, generator=g)
    chunks = upcast_chunks(head)
    assert [c.shape[0] for c in chunks] == [LOGIT_CHUNK, 100]
    assert torch.equal(fp32_logits(hidden, head, chunks), fp32_logits(hidden, head))
    assert upcast_chunks(head.float()) is None  # fp32 weights go straight through
