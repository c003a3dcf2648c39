"""kvconvert.models beyond the whole decoder (test_decoders): Llama's cached K/V and the RoPE of
models.common (frequencies, DeepSeek's yarn softmax scale) against transformers; configs refused."""

from __future__ import annotations

import pytest
import torch
from model_cases import LLAMA3, VOCAB, YARN, assert_matches, build, layer_weights

from kvconvert.errors import UnsupportedModelError
from kvconvert.models import deepseek_v3 as ds, llama
from kvconvert.models.common import rms_norm, rope_inv_freq, rope_parameters, yarn_softmax_scale

def test_cached_keys_and_values_match_transformers():
    """qkv gives the post-RoPE K and V transformers caches (what calibration observes)."""
    model, shape = build("llama")
    ids = torch.randint(0, VOCAB, (1, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        h = model.model.embed_tokens(ids)
        w = layer_weights(model.state_dict(), 0, llama.LlamaAttention, shape)
        _, k, v = llama.qkv(rms_norm(h, w.input_layernorm, shape.rms_eps), w.attn, shape)
    assert_matches(k, cache.layers[0].keys)
    assert_matches(v, cache.layers[0].values)


@pytest.mark.parametrize("rope", [LLAMA3, YARN, {**YARN, "factor": None, "mscale": None, "truncate": False}],
                         ids=["llama3", "yarn", "yarn-no-factor"])
def test_rope_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=256,
                      rope_parameters=dict(rope))
    hf_freq, hf_factor = ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, "cpu")
    ours, factor = rope_inv_freq(32, rope_parameters({"max_position_embeddings": 256, "rope_parameters": dict(rope)}), 256)
    torch.testing.assert_close(ours, hf_freq, atol=0, rtol=0)
    assert factor == pytest.approx(hf_factor, rel=1e-12)


def test_yarn_softmax_scale_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    assert yarn_softmax_scale(YARN, 32 ** -0.5) == pytest.approx(yarn_apply_mscale(YARN, 32 ** -0.5), rel=1e-12)
    assert yarn_softmax_scale(YARN, 32 ** -0.5) != 32 ** -0.5


def test_legacy_rope_scaling_keys_are_read():
    params = rope_parameters({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0},
                              "max_position_embeddings": 64})
    assert params == {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}
    freq, _ = rope_inv_freq(8, params, 64)
    torch.testing.assert_close(freq, 0.5 / (5e5 ** (torch.arange(0, 8, 2).float() / 8)))


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "longrope"}])
def test_unsupported_rope_is_a_clear_error(rope):
    with pytest.raises(UnsupportedModelError, match="not supported"):
        rope_parameters({"rope_parameters": rope, "max_position_embeddings": 64})


@pytest.mark.parametrize("read, config, message", [
    (llama.LlamaShape.from_config, {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 2},
     "not a multiple of num_key_value_heads"),
    (ds.check_dense, {"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8},
     "first_k_dense_replace=1"),  # MoE layers
], ids=["llama-heads", "deepseek-moe"])
def test_unsupported_configs_are_refused(read, config, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read(config)
