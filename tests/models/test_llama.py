"""kvconvert.models.llama beyond the decoder (test_decoders), and the RoPE of models.common, against
transformers."""

from __future__ import annotations

import pytest
import torch
from model_cases import LLAMA3, VOCAB, YARN, assert_matches, build, layer_weights

from kvconvert.errors import UnsupportedModelError
from kvconvert.models import llama
from kvconvert.models.common import rms_norm, rope_inv_freq, rope_parameters

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


def test_heads_not_a_multiple_of_kv_heads_is_refused():
    with pytest.raises(UnsupportedModelError, match="not a multiple of num_key_value_heads"):
        llama.LlamaShape.from_config({"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 2})
