"""kvconvert.models.deepseek_v3 against transformers' DeepseekV3ForCausalLM: random small dense
configs (interleaved and rotate_half RoPE, low-rank queries, yarn, biases), fp32, the whole
decoder's logits within 1e-5 relative."""

from __future__ import annotations

import pytest
import torch
from model_cases import VOCAB, assert_matches, functional_logits, random_norms

from kvconvert.errors import UnsupportedModelError
from kvconvert.models import deepseek_v3 as ds
from kvconvert.models.common import yarn_softmax_scale

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}

VARIANTS = {
    "interleave": {},
    "rotate-half-qlora-yarn-bias": dict(rope_interleave=False, q_lora_rank=24, rope_parameters=YARN, attention_bias=True),
    "interleave-qlora": dict(q_lora_rank=24),
}


def build(**kw):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
           "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24, "first_k_dense_replace": 2,
           "n_routed_experts": 4, "tie_word_embeddings": False, "max_position_embeddings": 256,
           "rope_interleave": True, "initializer_range": 0.15, **kw}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).eval()
    random_norms(model)
    return model, ds.MLAShape.from_config(model.config.to_dict())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decoder_matches_transformers(variant):
    model, shape = build(**VARIANTS[variant])
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        ours = functional_logits(model, ids, shape, ds.MLAAttention, ds.layer)
    assert_matches(ours, ref)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_runs_on_the_input_device(device):
    """No constant (positions, RoPE tables) is made on the CPU (see test_llama's twin)."""
    model, shape = build()
    ids = torch.randint(0, VOCAB, (2, 16))
    assert functional_logits(model, ids, shape, ds.MLAAttention, ds.layer, device).device.type == device


def test_yarn_softmax_scale_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    assert yarn_softmax_scale(YARN, 32 ** -0.5) == pytest.approx(yarn_apply_mscale(YARN, 32 ** -0.5), rel=1e-12)
    assert yarn_softmax_scale(YARN, 32 ** -0.5) != 32 ** -0.5


def test_moe_layers_are_refused():
    with pytest.raises(UnsupportedModelError, match="first_k_dense_replace=1"):
        ds.check_dense({"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8})
