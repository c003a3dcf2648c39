"""Model implementations by architecture; `load_model(reader, dtype)` picks one from config.json."""

from __future__ import annotations

import torch

from kvconvert.kvmath import MLA, kv_shape
from kvconvert.models.registry import ARCHITECTURES, architecture
from kvconvert.runtime.kv_cache import CacheSpec

# config model_type -> (module, class), derived from the one architecture registry. Imported lazily
# so one model's problem cannot break another.
MODELS = {kind: tuple(a.runtime_class.split(":")) for kind, a in ARCHITECTURES.items()}


def model_type(config: dict) -> str:
    """The registry's model_type for a config.json; an unknown one is refused naming the supported."""
    return architecture(config, "the runtime").model_type


def kv_layout(config: dict) -> list[dict[str, CacheSpec]]:
    """The cache layout (list over layers of {name: CacheSpec}) from config.json alone, as
    kvconvert.kvmath.kv_shape counts it. Per layer and token, MLA (deepseek_v3) caches one row "kv"
    [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]; Llama (MHA/GQA/MQA) caches post-RoPE "k"
    and "v", each [kv_heads, head_dim]."""
    model_type(config)  # an architecture the runtime lacks fails here, naming the supported ones
    shape = kv_shape(config)
    if shape.kind == MLA:
        row = CacheSpec((shape.kv_lora_rank + shape.qk_rope_head_dim,), rope_tail=shape.qk_rope_head_dim)
        return [{"kv": row} for _ in range(shape.num_layers)]
    row = CacheSpec((shape.num_kv_heads, shape.head_dim))
    return [{"k": row, "v": row} for _ in range(shape.num_layers)]


def stored_dtype(reader) -> torch.dtype:
    """The dtype the checkpoint stores its weights in (that of the token embeddings)."""
    return reader.stored_dtype("model.embed_tokens.weight")


def load_model(reader, dtype: torch.dtype, max_positions: int | None = None, device: torch.device | str = "cpu"):
    """Build the runtime model for the checkpoint behind `reader` (a CheckpointReader), its weights in
    dtype (views of the mapped files when that is the stored dtype, else converted copies) on device
    (copied tensor by tensor; on the CPU they stay mapped)."""
    import importlib

    module, cls = MODELS[model_type(reader.config)]
    model_cls = getattr(importlib.import_module(module), cls)
    return model_cls(reader, dtype=dtype, max_positions=max_positions, device=device)
