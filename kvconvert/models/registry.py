"""Every architecture kvconvert knows, declared once (torch-free, so any module may import it).

Each entry says which config.json `model_type` (and transformers class) it is, which
kvconvert.models module holds its maths, which class of the bundled runtime runs it, and its role:
a "source" is an MHA/GQA model that `kvconvert mla` converts (and calibrate streams as GQA), the
"target" is the stock DeepSeek-V3 MLA format it writes. The converter's supported list, the
runtime's model table, calibration's streaming rules and healing's student check all derive from
ARCHITECTURES, so they cannot disagree.

Mistral is Llama's maths exactly (RMSNorm, SwiGLU, RoPE, GQA, no biases) once its sliding window
is off or no shorter than the context (v0.3 and later: sliding_window null); a window that drops
tokens is refused for every architecture by mla.deepseek_format.unsupported_features.
"""

from __future__ import annotations

from dataclasses import dataclass

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
