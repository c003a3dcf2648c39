"""Every architecture kvconvert knows, declared once (torch-free, so any module may import it).

Each entry says which config.json `model_type` (and transformers class) it is, which
kvconvert.models module holds its maths, which class of the bundled runtime runs it, and its role:
a "source" is an MHA/GQA model that `kvconvert mla` converts (and calibrate streams as GQA), the
"target" is the stock DeepSeek-V3 MLA format it writes. The converter's supported list, the
runtime's model table, calibration's streaming rules and healing's student check all derive from
ARCHITECTURES, so they cannot disagree.

Mistral is Llama's maths exactly (RMSNorm, SwiGLU, RoPE, GQA, no biases) once its sliding window
is off or no shorter than the context (v0.3 and later: sliding_window null); a window that drops
tokens is refused for every architecture by unsupported_features below.

Also here, torch-free: the checkpoint tensor names of a source layer and of a target layer (which
the converter, the checkpoint checks and healing read and write), and the config.json features
that no kvconvert path computes (refused by every command that reads a model).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconvert import kvmath
from kvconvert.errors import UnsupportedModelError

SOURCE, TARGET = "source", "target"


@dataclass(frozen=True)
class Architecture:
    model_type: str  # config.json model_type
    transformers_class: str  # config.json architectures[0], transformers' class name
    maths: str  # the kvconvert.models module with its shapes, weights and layer maths
    runtime_class: str  # "module:Class" of the bundled runtime's model (imported lazily)
    role: str  # SOURCE (MHA/GQA, converted by `kvconvert mla`) or TARGET (DeepSeek-V3 MLA)

    def __post_init__(self):
        if self.role not in (SOURCE, TARGET):
            raise ValueError(f"{self.model_type}: role must be {SOURCE!r} or {TARGET!r}, not {self.role!r}")


_LLAMA_RUNNER = "kvconvert.runtime.models.llama:LlamaForCausalLM"
ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", "LlamaForCausalLM", "llama", _LLAMA_RUNNER, SOURCE),
    Architecture("mistral", "MistralForCausalLM", "llama", _LLAMA_RUNNER, SOURCE),
    Architecture("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3",
                 "kvconvert.runtime.models.deepseek_v3:DeepseekV3ForCausalLM", TARGET),
)}

SOURCE_MODEL_TYPES = frozenset(k for k, a in ARCHITECTURES.items() if a.role == SOURCE)
TARGET_MODEL_TYPE = next(k for k, a in ARCHITECTURES.items() if a.role == TARGET)
_BY_CLASS = {a.transformers_class: a for a in ARCHITECTURES.values()}


def supported_names() -> str:
    return ", ".join(f"{a.model_type} ({a.transformers_class})" for a in ARCHITECTURES.values())


def architecture(config: dict, what: str = "kvconvert") -> Architecture:
    """The entry for a config.json: by model_type, else by its transformers class (architectures)."""
    found = ARCHITECTURES.get(config.get("model_type"))
    if found is None:
        found = next((_BY_CLASS[c] for c in config.get("architectures") or [] if c in _BY_CLASS), None)
    if found is None:
        arch = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise UnsupportedModelError(
            f"model_type {config.get('model_type')!r} ({arch}) is not supported by {what}; "
            f"supported: {supported_names()}")
    return found


# Checkpoint tensor names ({i} = layer index). Norms and MLP: the same name in a source and in a
# target layer (source name -> target name; the converter copies them as they are).
COPIED_LAYER_TENSORS = {
    "model.layers.{i}.input_layernorm.weight": "model.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
}
SOURCE_ATTENTION = {  # a source (Llama-family) layer's attention, by short name
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
}
TARGET_ATTENTION = {  # a target (DeepSeek-V3 MLA) layer's attention, by short name
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "q_a_proj": "model.layers.{i}.self_attn.q_a_proj.weight",
    "q_a_layernorm": "model.layers.{i}.self_attn.q_a_layernorm.weight",
    "q_b_proj": "model.layers.{i}.self_attn.q_b_proj.weight",
    "kv_a_proj_with_mqa": "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_layernorm": "model.layers.{i}.self_attn.kv_a_layernorm.weight",
    "kv_b_proj": "model.layers.{i}.self_attn.kv_b_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
}


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
