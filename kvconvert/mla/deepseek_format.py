"""The stock DeepSeek-V3 checkpoint format that kvconvert writes (docs/formats.md, "DeepSeek-V3 MLA checkpoints").

Literal rename table (gpt-fast style) from Llama names to DeepSeek-V3 names for everything that is
copied unchanged, plus the config builder. Attention tensors are produced by convert_layer.
"""

from __future__ import annotations

from kvconvert import kvmath
from kvconvert.errors import UnsupportedModelError
from kvconvert.models.registry import SOURCE_MODEL_TYPES

# source name -> target name, for tensors copied as they are ({i} = layer index)
COPIED_LAYER_TENSORS = {
    "model.layers.{i}.input_layernorm.weight": "model.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
}
SOURCE_ATTENTION = {
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
}
TARGET_ATTENTION = {
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "q_a_proj": "model.layers.{i}.self_attn.q_a_proj.weight",
    "q_a_layernorm": "model.layers.{i}.self_attn.q_a_layernorm.weight",
    "q_b_proj": "model.layers.{i}.self_attn.q_b_proj.weight",
    "kv_a_proj_with_mqa": "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_layernorm": "model.layers.{i}.self_attn.kv_a_layernorm.weight",
    "kv_b_proj": "model.layers.{i}.self_attn.kv_b_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
}

SUPPORTED_MODEL_TYPES = SOURCE_MODEL_TYPES  # what `kvconvert mla` converts: models/registry.py
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


# Config keys that change the attention or logits math in ways no kvconvert path implements
# (conversion, calibration and the runtime all compute plain full-context softmax attention).
UNSUPPORTED_KEYS = {
    "attn_logit_softcapping": "attention-logit soft-capping",
    "final_logit_softcapping": "final-logit soft-capping",
    "attention_chunk_size": "chunked attention",
    "use_qk_norm": "query/key normalization (qk-norm)",
    "qk_layernorm": "query/key normalization (qk-norm)",
}


def unsupported_features(cfg: dict) -> list[str]:
    """What in a config.json no kvconvert path computes, one phrase each ([] = nothing).

    Shared by every command that reads a model (mla, calibrate, generate, validate) and by
    `inspect`, so a feature refused on one path is refused on all. A sliding window counts only
    when it is shorter than max_position_embeddings (otherwise it never drops a token); which
    layers use one follows kvmath.layer_windows (the same rule `inspect` and `budget` use)."""
    text = kvmath.text_config(cfg)
    found = []
    try:
        windows = kvmath.layer_windows(text)
    except (KeyError, TypeError):
        windows = []
    limit = text.get("max_position_embeddings")
    sliding = [w for w in windows if w is not None and (not isinstance(limit, int) or w < limit)]
    if sliding:
        flag = f", use_sliding_window={text['use_sliding_window']}" if "use_sliding_window" in text else ""
        found.append(f"sliding-window attention (sliding_window={text['sliding_window']}{flag}: "
                     f"{len(sliding)} of {len(windows)} layers)")
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types) and not sliding:
        kinds = sorted({str(t) for t in layer_types if t != "full_attention"})
        found.append(f"layer_types {', '.join(kinds)} (only full_attention is computed)")
    for key, what in UNSUPPORTED_KEYS.items():
        if text.get(key) not in (None, False, 0):
            found.append(f"{what} ({key}={text[key]!r})")
    return found


def check_supported_features(cfg: dict, where: str = "config.json") -> None:
    """Refuse a config whose attention no kvconvert path computes: the result would silently
    differ from the source (a sliding-window model converted or run as full attention)."""
    found = unsupported_features(cfg)
    if found:
        raise UnsupportedModelError(
            f"{where}: not supported: {'; '.join(found)}. kvconvert converts, calibrates and runs full-context "
            "attention only, so the result would silently differ from the model; if the model was trained "
            "without it, remove the key from config.json")


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
