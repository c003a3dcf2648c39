"""The runtime's shortcuts for CPU speed compute exactly what the plain paths compute (bit for bit):
the FP8 / INT8 cache read through a table of the 256 codes, a quantized cache read from its decoded copy, and a
small 16-bit lm_head upcast once."""

from __future__ import annotations

import pytest
import torch

from kvconvert.kernels.cache_layout import dequantize_rows
from kvconvert.runtime.kv_cache import (CacheSpec, Workspace, add_decoded_copy, code_table_dequantize, gather, make_layer,
                                        write)
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


# A quantized layer's decoded copy (add_decoded_copy): rows decoded once, as written, read by gather instead of the
# stored cache. GQA [3 heads x 64] and MLA [32 latent + 32 rope] rows; scales where the format has them.
DECODED_CASES = [("fp8", False), ("int8", False), ("nvfp4", False), ("q4_0", False), ("q5_0/iq4_nl", False),
                 ("fp8", True), ("nvfp4", True), ("nvfp4_fp8rope", True), ("q8_0", True)]


def _layers(kv_dtype: str, mla: bool):
    specs = {"kv": CacheSpec((64,), rope_tail=32)} if mla else {"k": CacheSpec((3, 64)), "v": CacheSpec((3, 64))}
    scales = {"kv": torch.tensor(0.05)} if mla else {"k": torch.tensor([[0.02], [0.1], [0.5]]), "v": torch.tensor(0.03)}
    stored, decoded = (make_layer(kv_dtype, 8, 4, specs, scales) for _ in range(2))
    add_decoded_copy(decoded, torch.float32)
    return stored, decoded


@pytest.mark.parametrize("kv_dtype, mla", DECODED_CASES)
def test_decoded_copy_reads_what_the_stored_cache_reads(kv_dtype, mla):
    """Written in two steps at scattered slots, a block copied (copy-on-write), then gathered in fp32 and bf16:
    the copy gives the stored cache's values bit for bit."""
    stored, decoded = _layers(kv_dtype, mla)
    g = torch.Generator().manual_seed(0)
    shape = (12, 32) if mla else (12, 3, 64)
    first, second = torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g)
    for slots in (torch.tensor([0, 1, 2, 3, 8, 9, 10]), torch.tensor([11, 20, 21, 22, 23])):
        n = len(slots)
        for layer in (stored, decoded):
            write(layer, first[:n], second[:n], slots, Workspace())
        first, second = first[n:], second[n:]
    for layer in (stored, decoded):  # block 2 -> block 6, as PagedKVCache.copy_blocks does
        for t in [*layer.block_tensors(), *(getattr(layer, "decoded", None) or {}).values()]:
            t[6] = t[2]
    tables = torch.tensor([[0, 2, 5, 6], [6, 0, 0, 2]])
    for name in ("kv",) if mla else ("k", "v"):
        for dtype in (torch.float32, torch.bfloat16):
            want, got = (gather(layer, name, tables, torch.empty(2, 16, *layer.row_shape, dtype=dtype), Workspace())
                         for layer in (stored, decoded))
            assert torch.equal(_bits(got), _bits(want)), (name, dtype)
    assert not hasattr(stored, "decoded")


def test_an_unquantized_layer_has_no_decoded_copy():
    layer = make_layer("bf16", 2, 4, {"k": CacheSpec((1, 32)), "v": CacheSpec((1, 32))}, {})
    add_decoded_copy(layer, torch.float32)
    assert getattr(layer, "decoded", None) is None


@pytest.mark.filterwarnings("ignore:kv_scales='dynamic'")
@pytest.mark.parametrize("kv_dtype", ["q5_0/iq4_nl", "fp8"])
def test_engine_with_a_decoded_copy_gives_the_same_logits_and_tokens(kv_dtype, tmp_path):
    """Through LLM (chunked prefill, prefix caching, a batch of decodes): decoded_copy changes nothing but speed."""
    from runtime_cases import build, greedy, random_ids

    from kvconvert.runtime import LLM

    model = build(tmp_path / "m", "llama", head_dim=64, tie_word_embeddings=True)
    ids = random_ids(70, seed=3)
    runs = []
    for copy in (False, True):
        llm = LLM(model, kv_dtype=kv_dtype, kv_scales="dynamic", block_size=4, num_blocks=120, max_num_seqs=4,
                  max_num_batched_tokens=24, dtype="fp32", decoded_copy=copy)
        assert hasattr(llm.cache.layers[0], "decoded") == copy
        scores = llm.score(ids, 40)
        outs = llm.generate([ids[:50], ids[:61], ids[:33]], greedy(8))  # the first two share 12 cached blocks
        runs.append((scores, [o.token_ids for o in outs], outs[1].num_cached_tokens))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1:] == runs[1][1:] and runs[1][2] > 0


def test_decoded_copy_is_the_torch_backends():
    from kvconvert.errors import KVConvertError
    from kvconvert.runtime.config import EngineConfig

    with pytest.raises(KVConvertError, match="decoded_copy is the torch attention backend's"):
        EngineConfig(kv_dtype="fp8", attention_backend="triton", decoded_copy=True)
