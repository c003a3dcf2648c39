"""Run kvconvert.models' functional decoder on a transformers model's own weights (shared by this
folder's tests; a uniquely named module so `from model_cases import ...` resolves here)."""

from __future__ import annotations

import torch

from kvconvert.models import deepseek_v3 as ds, llama
from kvconvert.models.common import DecoderLayer, rms_norm, short_names

VOCAB = 96
LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}


# transformers' model_type: kvconvert's shape, typed attention and layer maths, a small random config
ARCHS = {
    "llama": (llama.LlamaShape, llama.LlamaAttention, llama.layer,
              {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
               "rms_norm_eps": 1e-5, "initializer_range": 0.15}),
    "deepseek_v3": (ds.MLAShape, ds.MLAAttention, ds.layer,
                    {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
                     "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24, "first_k_dense_replace": 2,
                     "n_routed_experts": 4, "tie_word_embeddings": False, "max_position_embeddings": 256,
                     "rope_interleave": True, "initializer_range": 0.15}),
}
# config changes each decoder is checked on (deepseek_v3: interleaved and rotate_half RoPE,
# low-rank queries, yarn, biases)
VARIANTS = {
    ("llama", "gqa"): {},
    ("llama", "mha-llama3-bias"): dict(num_key_value_heads=4, rope_parameters=LLAMA3, attention_bias=True,
                                       mlp_bias=True),
    ("llama", "mqa-linear-untied"): dict(num_key_value_heads=1, tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}),
    ("deepseek_v3", "interleave"): {},
    ("deepseek_v3", "rotate-half-qlora-yarn-bias"): dict(rope_interleave=False, q_lora_rank=24, rope_parameters=YARN,
                                                         attention_bias=True),
    ("deepseek_v3", "interleave-qlora"): dict(q_lora_rank=24),
}


def build(arch: str, **kw):
    """A random transformers model of `arch` (eval mode, random norms) with the config changes kw,
    and its kvconvert shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **{**ARCHS[arch][3], **kw})).eval()
    random_norms(model)
    return model, ARCHS[arch][0].from_config(model.config.to_dict())


def random_norms(model, seed: int = 0) -> None:
    """Random RMSNorm weights (transformers initialises them to 1, which would hide norm bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))


def functional_logits(model, ids: torch.Tensor, shape, arch: str, device="cpu") -> torch.Tensor:
    """Logits [B, T, vocab] of ids [B, T] through arch's layer over the model's weights on `device`."""
    state = {k: v.detach().to(device) for k, v in model.state_dict().items()}
    h = state["model.embed_tokens.weight"][ids.to(device)]
    _, attention_cls, layer, _ = ARCHS[arch]
    for i in range(shape.layers):
        h = layer(h, layer_weights(state, i, attention_cls, shape), shape)
    return rms_norm(h, state["model.norm.weight"], shape.rms_eps) @ state["lm_head.weight"].T


def layer_weights(state: dict, i: int, attention_cls, shape) -> DecoderLayer:
    """Layer i of a transformers state dict as the runtime reads it (checkpoint names -> typed weights)."""
    prefix = f"model.layers.{i}."
    return DecoderLayer.of(short_names({k: v for k, v in state.items() if k.startswith(prefix)}), attention_cls,
                           shape.hidden_act)


def assert_matches(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """Relative error |ours - ref| / |ref| over the whole tensor below rtol."""
    err = float((ours - ref).norm() / ref.norm())
    assert err < rtol, f"relative error {err:.3g} >= {rtol}"
