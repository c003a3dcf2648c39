"""What the serving engine caches for each attention layer of a checkpoint.

Two families are recognised from the checkpoint's tensor names (never from class names alone):

* ``gqa`` - Llama-style MHA/GQA (``self_attn.{q,k,v,o}_proj``): the engine caches post-RoPE K and V,
  ``[tokens, num_kv_heads, head_dim]`` each, one scale each (per tensor or per KV head).
* ``mla`` - stock DeepSeek-V3 (``model_type == "deepseek_v3"``, ``self_attn.kv_a_proj_with_mqa``):
  the engine caches ONE row per token, ``[latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]``,
  the latent taken after ``kv_a_layernorm`` and k_rope after RoPE. vLLM's MLA path applies a single
  ``k_scale`` to that whole row, so kvconvert calibrates one scale per layer for it (``row_dim`` =
  kv_lora_rank + qk_rope_head_dim, ``num_kv_heads`` = 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvconvert.errors import UnsupportedModelError

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([A-Za-z_]+)\.weight$")
GQA_PROJ = {"q_proj", "k_proj", "v_proj", "o_proj"}


@dataclass(frozen=True)
class KVLayout:
    """Shape of the cached K/V of a checkpoint (see module docstring)."""

    kind: str  # "gqa" or "mla"
    num_layers: int
    num_kv_heads: int  # KV heads per layer; 1 for MLA (one cached row)
    head_dim: int  # gqa: K/V head_dim; mla: kv_lora_rank + qk_rope_head_dim
    num_q_heads: int
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    rope_interleave: bool = False

    def __post_init__(self):
        if self.kind not in ("gqa", "mla"):
            raise UnsupportedModelError(f"unknown KV layout {self.kind!r}")
        if self.num_layers <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise UnsupportedModelError(f"invalid attention shape in config: {self}")

    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    @property
    def kinds(self) -> tuple[str, ...]:
        """Names of the cached tensors per layer: ("k", "v") for gqa, ("kv",) for the MLA row."""
        return ("kv",) if self.is_mla else ("k", "v")


def detect_kv_layout(config: dict, tensor_names: list[str]) -> KVLayout:
    """KVLayout from an HF ``config.json`` dict and the checkpoint's tensor names.

    Raises UnsupportedModelError when no attention layer kvconvert recognises is present.
    """
    text = config.get("text_config", config)
    per_layer: dict[int, set[str]] = {}
    for name in tensor_names:
        m = _LAYER_RE.match(name)
        if m:
            per_layer.setdefault(int(m.group(1)), set()).add(m.group(2))
    mla_layers = sorted(i for i, mods in per_layer.items() if "kv_a_proj_with_mqa" in mods)
    gqa_layers = sorted(i for i, mods in per_layer.items() if GQA_PROJ <= mods)
    if mla_layers:
        return _mla_layout(text, mla_layers)
    if gqa_layers:
        return _gqa_layout(text, gqa_layers)
    raise UnsupportedModelError(
        f"no attention layers kvconvert recognises (model_type {text.get('model_type')!r}): expected "
        "model.layers.N.self_attn.{q,k,v,o}_proj (Llama MHA/GQA) or self_attn.kv_a_proj_with_mqa "
        "(DeepSeek-V3 MLA)")


def _check_contiguous(layers: list[int], num_layers: int, what: str) -> None:
    if layers != list(range(num_layers)):
        raise UnsupportedModelError(
            f"{what} attention found in layers {layers[:4]}... but config has num_hidden_layers="
            f"{num_layers}: every decoder layer must have a recognised attention block")


def _gqa_layout(cfg: dict, layers: list[int]) -> KVLayout:
    n_layers = int(cfg.get("num_hidden_layers", 0))
    _check_contiguous(layers, n_layers, "MHA/GQA")
    n_heads = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads)
    return KVLayout("gqa", n_layers, n_kv, head_dim, n_heads)


def _mla_layout(cfg: dict, layers: list[int]) -> KVLayout:
    if cfg.get("model_type") != "deepseek_v3":
        raise UnsupportedModelError(
            f"MLA tensors found but model_type is {cfg.get('model_type')!r}: only stock deepseek_v3 "
            "checkpoints are supported (convert with `kvconvert mla`)")
    n_layers = int(cfg.get("num_hidden_layers", 0))
    _check_contiguous(layers, n_layers, "MLA")
    rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    return KVLayout("mla", n_layers, 1, rank + rope, int(cfg["num_attention_heads"]),
                    kv_lora_rank=rank, qk_rope_head_dim=rope,
                    rope_interleave=bool(cfg.get("rope_interleave", False)))
