"""The planner's KV bytes (kvconvert.kvmath: `budget`, `inspect`) equal what the runtime really
allocates (the bytes of kvconvert.runtime's cache tensors), for every registry format and architecture."""

from __future__ import annotations

import pytest

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import ALIASES, KV_FORMATS, RUNTIME_KV_DTYPES, kv_format
from kvconvert.kvmath import MLA, kv_bytes_per_token, kv_shape
from kvconvert.runtime.kv_cache import PagedKVCache, bytes_per_token
from kvconvert.runtime.models import kv_layout

LLAMA_GQA = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "hidden_size": 576, "head_dim": 64}
LLAMA_MHA = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "hidden_size": 4096}
DEEPSEEK = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
            "first_k_dense_replace": 61, "n_routed_experts": 1}
SMOLLM2_MLA = {**DEEPSEEK, "num_hidden_layers": 30, "num_attention_heads": 9, "hidden_size": 576,
               "kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64}
CONFIGS = pytest.mark.parametrize("config", [LLAMA_GQA, LLAMA_MHA, DEEPSEEK, SMOLLM2_MLA],
                                  ids=["llama-gqa", "llama-mha", "deepseek-v3", "smollm2-mla-320"])


@CONFIGS
@pytest.mark.parametrize("kv_dtype", [*KV_FORMATS, *ALIASES])
def test_planner_bytes_equal_runtime_allocated_bytes(config, kv_dtype):
    if kv_format(kv_dtype).mla_only and kv_shape(config).kind != MLA:  # nvfp4_fp8rope: both refuse it up front
        for count in (lambda: kv_bytes_per_token(kv_shape(config), kv_dtype),
                      lambda: PagedKVCache(kv_layout(config), 1, 1, kv_dtype, dynamic=True)):
            with pytest.raises(KVConvertError, match="per-head K and V"):
                count()
        return
    planned = kv_bytes_per_token(kv_shape(config), kv_dtype)
    if kv_dtype not in RUNTIME_KV_DTYPES:  # planning-only formats (int4): the runtime refuses them
        with pytest.raises(KVConvertError, match="not supported; choose one of"):
            PagedKVCache(kv_layout(config), 1, 1, kv_dtype, dynamic=True)
        return
    cache = PagedKVCache(kv_layout(config), num_blocks=1, block_size=1, kv_dtype=kv_dtype, dynamic=True)
    assert planned == cache.bytes_per_token == bytes_per_token(kv_layout(config), kv_dtype)


def test_what_one_layer_caches():
    """KVShape's cached tensors (kvconvert.quant calibrates one scale per tensor, per head or per row)."""
    for config, names, heads, row_dim in ((LLAMA_GQA, ("k", "v"), 3, 64), (LLAMA_MHA, ("k", "v"), 32, 128),
                                          (DEEPSEEK, ("kv",), 1, 512 + 64)):
        shape = kv_shape(config)
        assert (shape.cached_names, shape.cached_heads, shape.row_dim) == (names, heads, row_dim)
        assert shape.cached_vectors == [row_dim] * (len(names) * heads)
    assert not kv_shape({**DEEPSEEK, "rope_interleave": False}).rope_interleave


def test_absent_rope_interleave_reads_as_transformers_does():
    """A DeepSeek config without the key (the published DeepSeek-V3 one) is interleaved: transformers'
    default, and vLLM's DeepSeek rotary is always GPT-J style. Calibration pairs k_rope channels by it."""
    from transformers import DeepseekV3Config

    assert "rope_interleave" not in DEEPSEEK
    assert kv_shape(DEEPSEEK).rope_interleave == DeepseekV3Config().rope_interleave


@CONFIGS
@pytest.mark.parametrize("kv_dtype", ["q5_0/iq4_nl", "q8_0/q4_0"])
def test_a_pairs_planned_bytes_are_the_runtimes_and_each_halfs(config, kv_dtype):
    """K and V apart (KTYPE/VTYPE): the sum of K's vectors in K's format and V's in V's; refused for MLA by both."""
    shape = kv_shape(config)
    if shape.kind == MLA:
        for count in (lambda: kv_bytes_per_token(shape, kv_dtype),
                      lambda: PagedKVCache(kv_layout(config), 1, 1, kv_dtype)):
            with pytest.raises(KVConvertError, match="MLA model caches one row"):
                count()
        return
    k, v = kv_dtype.split("/")
    planned = kv_bytes_per_token(shape, kv_dtype)
    assert 2 * planned == kv_bytes_per_token(shape, k) + kv_bytes_per_token(shape, v)
    assert planned == PagedKVCache(kv_layout(config), 1, 1, kv_dtype).bytes_per_token
