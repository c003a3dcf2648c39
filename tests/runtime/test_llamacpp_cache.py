"""The runtime's llama.cpp caches (kv_dtype q8_0, q4_0, iq4_nl, ...) against transformers with the same K/V
quantize-dequantized by kvconvert.quant.hooks.llamacpp_hook (both through kvconvert.ggml_formats' frames).

The runtime stores the engine's bytes (blocks of 32 values with fp16 scales, after llama.cpp's channel order and
Hadamard rotation) and reads them back; the reference rounds the same values on the way into transformers' cache.
fp32 logits agree to rounding (atol 1e-4) and greedy tokens are identical; llama.cpp's own numbers are compared
in tests/engines/test_llamacpp.py.
"""

from __future__ import annotations

import pytest
import torch

from kvconvert.checkpoint import read_config
from kvconvert.errors import KVConvertError
from kvconvert.ggml_formats import GGML_TYPES, ROTATION_ENV
from kvconvert.kvformat import kv_format
from kvconvert.kvmath import kv_shape
from kvconvert.quant.capture import KVHookCache
from kvconvert.quant.hooks import llamacpp_hook
from kvconvert.runtime import LLM
from runtime_cases import build, greedy, load_reference, random_ids, transformers_reference

ATOL = 1e-4


@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    """Head dim 64: llama.cpp rotates a quantized cache only when the head is a multiple of 64."""
    return build(tmp_path_factory.mktemp("llama64"), "llama", head_dim=64, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def mla64(tmp_path_factory):
    """kv_lora_rank 32 + rope 32: the cached row is two blocks of 32."""
    return build(tmp_path_factory.mktemp("mla64"), "deepseek_v3", kv_lora_rank=32, qk_rope_head_dim=32)


CASES = [("llama", "q4_0", True), ("llama", "q4_0", False), ("llama", "q8_0", True), ("llama", "iq4_nl", True),
         ("llama", "q5_1", True), ("deepseek", "q4_0", True), ("deepseek", "q5_0", True),
         ("llama", "q5_0/iq4_nl", True), ("llama", "iq4_nl/q8_0", False)]  # K and V in two types (-ctk / -ctv)


@pytest.mark.parametrize("arch, kv_dtype, rotate", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_runtime_cache_matches_the_hook(arch, kv_dtype, rotate, llama64, mla64, monkeypatch):
    path = llama64 if arch == "llama" else mla64
    if not rotate:
        monkeypatch.setenv(ROTATION_ENV, "1")  # llama.cpp's own switch, read by both sides
    ref = load_reference(path)
    shape = kv_shape(read_config(path))
    prompt = random_ids(20)
    ref_logits, ref_tokens = transformers_reference(
        ref, prompt, 24, lambda: KVHookCache(llamacpp_hook(shape, kv_dtype), config=ref.config))
    with torch.no_grad():
        exact = ref(torch.tensor([prompt])).logits[0]
    assert (ref_logits - exact).abs().max() > 10 * ATOL, "quantization too weak for this test to see it"

    llm = LLM(path, kv_dtype=kv_dtype, block_size=4, max_num_batched_tokens=8)
    torch.testing.assert_close(llm.score(prompt), ref_logits, atol=ATOL, rtol=0)
    assert llm.generate([prompt], greedy(24))[0].token_ids == ref_tokens
    layer = llm.cache.layers[0]
    assert layer.mode == "ggml"
    frames = list(layer.frames.values())
    if arch == "llama":
        assert (frames[0].rotation == 64) == rotate and frames[0].order is not None  # K: llama.cpp's pair order
        assert frames[1].order is None  # V keeps its channels
    else:
        assert frames[0].rotation is None  # llama.cpp's absorbed MLA path rotates nothing


@pytest.mark.parametrize("kv_dtype", ["q4_0", "q8_0", "q5_1"])
def test_bytes_are_the_engines(kv_dtype, llama64, mla64):
    """The stored bytes per token: every K/V row in blocks of 32 with their scales (kvformat's count)."""
    per_block = GGML_TYPES[kv_dtype].block_bytes
    for path in (llama64, mla64):
        shape = kv_shape(read_config(path))
        llm = LLM(path, kv_dtype=kv_dtype, block_size=4)
        expected = shape.num_layers * sum(v // 32 * per_block for v in shape.cached_vectors)
        assert llm.cache.bytes_per_token == expected
        assert expected == shape.num_layers * sum(kv_format(kv_dtype).vector_bytes(v) for v in shape.cached_vectors)


def test_triton_backend_refuses_a_llamacpp_cache(llama64):
    with pytest.raises(KVConvertError, match="Triton kernels"):
        LLM(llama64, kv_dtype="q4_0", attention_backend="triton")


def test_heads_not_in_whole_blocks_are_refused(llama_gqa):
    """head_dim 16: llama.cpp's blocks of 32 would straddle two heads; the engine refuses it, so does the runtime."""
    with pytest.raises(KVConvertError, match="blocks of 32 values, which do not divide the 16 values"):
        LLM(llama_gqa, kv_dtype="q4_0")


def test_a_pair_stores_k_and_v_each_in_its_type(llama64):
    """q5_0/iq4_nl: K rows in q5_0's 22-byte blocks, V rows in iq4_nl's 18; the bytes the sum of both halves."""
    shape = kv_shape(read_config(llama64))
    llm = LLM(llama64, kv_dtype="Q5_0/IQ4_NL", block_size=4)
    layer = llm.cache.layers[0]
    assert (layer.frames["k"].ggml_name, layer.frames["v"].ggml_name) == ("q5_0", "iq4_nl")
    assert llm.config.kv_dtype == "q5_0/iq4_nl"
    per_head = shape.head_dim // 32 * (22 + 18)
    assert llm.cache.bytes_per_token == shape.num_layers * shape.num_kv_heads * per_head


def test_mla_refuses_a_pair_and_shapes_llamacpp_cannot_serve(mla64, tmp_path):
    """MLA caches one row in llama.cpp's K cache: no V half. And llama.cpp needs kv_lora_rank itself (the V view) in
    whole blocks, not only the row: 48 + 16 is refused though the row is 64 values."""
    with pytest.raises(KVConvertError, match="MLA model caches one row"):
        LLM(mla64, kv_dtype="q5_0/iq4_nl")
    odd = build(tmp_path, "deepseek_v3", kv_lora_rank=48, qk_rope_head_dim=16)
    with pytest.raises(KVConvertError, match="do not divide the 48 values of a cached V head"):
        LLM(odd, kv_dtype="q4_0")
    LLM(odd, kv_dtype="bf16", block_size=4)  # a float cache serves every shape
