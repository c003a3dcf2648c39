"""kvconvert.models.llama (and the RoPE of models.common) against transformers' LlamaForCausalLM:
random small configs, fp32, the whole decoder's logits within 1e-5 relative. The functional
blocks compute RoPE angles in float64, transformers in fp32: only rounding differs."""

from __future__ import annotations

import pytest
import torch
from model_cases import VOCAB, assert_matches, functional_logits, layer_weights, random_norms

from kvconvert.errors import UnsupportedModelError
from kvconvert.models import llama
from kvconvert.models.common import rms_norm, rope_inv_freq, rope_parameters

LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}

VARIANTS = {
    "gqa": {},
    "mha-llama3-bias": dict(num_key_value_heads=4, rope_parameters=LLAMA3, attention_bias=True, mlp_bias=True),
    "mqa-linear-untied": dict(num_key_value_heads=1, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}),
}


def build(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-5, "initializer_range": 0.15, **kw}
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    random_norms(model)
    return model, llama.LlamaShape.from_config(model.config.to_dict())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decoder_matches_transformers(variant):
    model, shape = build(**VARIANTS[variant])
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        ours = functional_logits(model, ids, shape, llama.LlamaAttention, llama.layer)
    assert_matches(ours, ref)


def test_cached_keys_and_values_match_transformers():
    """qkv gives the post-RoPE K and V transformers caches (what calibration observes)."""
    model, shape = build()
    ids = torch.randint(0, VOCAB, (1, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        h = model.model.embed_tokens(ids)
        w = layer_weights(model.state_dict(), 0, llama.LlamaAttention, shape)
        _, k, v = llama.qkv(rms_norm(h, w.input_layernorm, shape.rms_eps), w.attn, shape)
    assert_matches(k, cache.layers[0].keys)
    assert_matches(v, cache.layers[0].values)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_runs_on_the_input_device(device):
    """No constant (positions, RoPE tables) is made on the CPU: `meta` fails on a device mismatch
    exactly as cuda would (the layer-wise stage runs these blocks on a GPU)."""
    model, shape = build()
    ids = torch.randint(0, VOCAB, (2, 16))
    assert functional_logits(model, ids, shape, llama.LlamaAttention, llama.layer, device).device.type == device


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
