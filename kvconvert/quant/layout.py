"""Which attention a checkpoint has, checked against its tensor names (never class names alone).

Two families are recognised; what each caches is kvconvert.kvmath.KVShape's:

* Llama-style MHA/GQA/MQA (``self_attn.{q,k,v,o}_proj``): the engine caches post-RoPE K and V,
  ``[tokens, num_kv_heads, head_dim]`` each, one scale each (per tensor or per KV head).
* stock DeepSeek-V3 MLA (``model_type == "deepseek_v3"``, ``self_attn.kv_a_proj_with_mqa``): the
  engine caches ONE row per token, ``[latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]``. vLLM's
  MLA path applies a single ``k_scale`` to that whole row, so kvconvert calibrates one scale per
  layer for it (KVShape.row_dim values, KVShape.cached_heads = 1).
"""

from __future__ import annotations

import re
from pathlib import Path

from kvconvert.errors import UnsupportedModelError
from kvconvert.kvmath import KVShape, kv_shape, text_config
from kvconvert.models.registry import TARGET_MODEL_TYPE

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([A-Za-z_]+)\.weight$")
GQA_PROJ = {"q_proj", "k_proj", "v_proj", "o_proj"}


def detect_kv_layout(config: dict, tensor_names: list[str]) -> KVShape:
    """KVShape of an HF ``config.json`` dict, once the checkpoint's tensor names show that every
    decoder layer has an attention block kvconvert recognises (UnsupportedModelError otherwise)."""
    text = text_config(config)
    per_layer: dict[int, set[str]] = {}
    for name in tensor_names:
        m = _LAYER_RE.match(name)
        if m:
            per_layer.setdefault(int(m.group(1)), set()).add(m.group(2))
    mla_layers = sorted(i for i, mods in per_layer.items() if "kv_a_proj_with_mqa" in mods)
    gqa_layers = sorted(i for i, mods in per_layer.items() if GQA_PROJ <= mods)
    if mla_layers and text.get("model_type") != TARGET_MODEL_TYPE:
        raise UnsupportedModelError(
            f"MLA tensors found but model_type is {text.get('model_type')!r}: only stock {TARGET_MODEL_TYPE} "
            "checkpoints are supported (convert with `kvconvert mla`)")
    if not mla_layers and not gqa_layers:
        raise UnsupportedModelError(
            f"no attention layers kvconvert recognises (model_type {text.get('model_type')!r}): expected "
            "model.layers.N.self_attn.{q,k,v,o}_proj (Llama MHA/GQA) or self_attn.kv_a_proj_with_mqa "
            "(DeepSeek-V3 MLA)")
    layers, what = (mla_layers, "MLA") if mla_layers else (gqa_layers, "MHA/GQA")
    num_layers = int(text.get("num_hidden_layers") or 0)
    if layers != list(range(num_layers)):
        raise UnsupportedModelError(
            f"{what} attention found in layers {layers[:4]}... but config has num_hidden_layers="
            f"{num_layers}: every decoder layer must have a recognised attention block")
    shape = kv_shape(text)
    if shape.is_mla != bool(mla_layers):
        raise UnsupportedModelError(f"{what} attention tensors but a config for {shape.kind} attention")
    return shape


def checkpoint_kv_layout(folder: str | Path) -> KVShape:
    """detect_kv_layout of a checkpoint folder: its config.json and its tensor names."""
    from kvconvert.checkpoint import CheckpointReader

    with CheckpointReader(folder, verify=False) as reader:
        return detect_kv_layout(reader.config, reader.keys())
