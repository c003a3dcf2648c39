"""The stock DeepSeek-V3 checkpoint format that kvconvert writes (docs/formats.md, "DeepSeek-V3 MLA checkpoints").

What `kvconvert mla` accepts as a source (check_source_config) and the DeepSeek-V3 config it writes
(deepseek_config). The tensor names of both sides and the config features no path computes are the
architectures' own (kvconvert.models.registry); attention tensors are produced by convert_layer.
"""

from __future__ import annotations

from kvconvert.errors import UnsupportedModelError
from kvconvert.models.registry import SOURCE_MODEL_TYPES, check_supported_features

SUPPORTED_MODEL_TYPES = SOURCE_MODEL_TYPES  # what `kvconvert mla` converts: models/registry.py
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def check_source_config(cfg: dict) -> None:
    """Refuse sources `kvconvert mla` would convert into a silently wrong model."""
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {mt!r} is not supported yet: kvconvert mla converts Llama-family checkpoints "
            f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))}); biases, qk-norm and sliding windows need their own path")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedModelError("not supported yet: attention/MLP biases (stock DeepSeek-V3 has none)")
    check_supported_features(cfg)
    from kvconvert.models.common import rope_parameters  # torch: imported here, this module is torch-free

    rope_parameters(cfg, SUPPORTED_ROPE_TYPES)
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"not supported yet: hidden_act {cfg.get('hidden_act')!r} (DeepSeek-V3 uses silu)")


def deepseek_config(src: dict, rank: int, rope_dim: int, nope_dim: int, v_dim: int, q_rank: int | None, dtype: str) -> dict:
    """config.json for transformers' DeepseekV3ForCausalLM / vLLM / SGLang, all layers dense."""
    from kvconvert.models.common import rope_parameters

    rope = rope_parameters(src, SUPPORTED_ROPE_TYPES)
    layers = src["num_hidden_layers"]
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": src["vocab_size"],
        "hidden_size": src["hidden_size"],
        "intermediate_size": src["intermediate_size"],
        "moe_intermediate_size": src["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": src["num_attention_heads"],
        "num_key_value_heads": src["num_attention_heads"],
        "n_shared_experts": 1,
        "n_routed_experts": 1,  # must be an integer; unused since every layer is dense
        "num_experts_per_tok": 1,
        "first_k_dense_replace": layers,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "kv_lora_rank": rank,
        "q_lora_rank": q_rank,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": nope_dim,
        "v_head_dim": v_dim,
        "hidden_act": "silu",
        "max_position_embeddings": src.get("max_position_embeddings", 4096),
        # 1e-6 everywhere: transformers hard-codes eps 1e-6 for kv_a_layernorm while vLLM/SGLang use
        # rms_norm_eps, so both agree only at 1e-6. The decoder norms barely notice 1e-5 -> 1e-6.
        "rms_norm_eps": 1e-6,
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "rope_scaling": None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"} | {"type": rope["rope_type"]},
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "bos_token_id": src.get("bos_token_id"),
        "eos_token_id": src.get("eos_token_id"),
        "pad_token_id": src.get("pad_token_id"),
        "initializer_range": src.get("initializer_range", 0.02),
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
