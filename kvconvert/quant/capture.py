"""See exactly what the engine caches: a transformers DynamicCache whose ``update`` hands the cached
tensors to a hook before storing them.

transformers 5.x calls ``past_key_values.update(key, value, layer_idx)`` with
* Llama MHA/GQA: post-RoPE K ``[b, kv_heads, T, head_dim]`` and V ``[b, kv_heads, T, head_dim]``;
* DeepseekV3 MLA: the latent after ``kv_a_layernorm`` ``[b, 1, T, kv_lora_rank]`` and the post-RoPE
  shared key ``[b, 1, T, qk_rope_head_dim]`` (modeling_deepseek_v3.DeepseekV3Attention.forward).
So one hook sees the cache contents of both families with no model-specific patching. The hook may
return modified tensors (fake quantization), which the attention then reads, as an engine would.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

from kvconvert.errors import KVConvertError, UnsupportedModelError
from kvconvert.kvmath import KVShape
from kvconvert.quant.fake_quant import mla_row_from_engine, mla_row_to_engine

# hook(layer_idx, key, value) -> (key, value), tensors in transformers' cache layout
CacheHook = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# row hook for the common code: (layer_idx, kind, x [b, heads, T, dim]) -> x
RowHook = Callable[[int, str, torch.Tensor], torch.Tensor]


class KVHookCache(DynamicCache):
    """DynamicCache that passes every ``update`` through ``hook`` (observe and/or fake-quantize)."""

    def __init__(self, hook: CacheHook, config=None):
        super().__init__(config=config)
        self.hook = hook

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        key_states, value_states = self.hook(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class ReplayCache:
    """Stateless stand-in for a cache when one attention module is replayed on recorded inputs:
    ``update`` returns the hooked tensors without storing them (attention modules call nothing else)."""

    def __init__(self, hook: CacheHook):
        self.hook = hook

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.hook(layer_idx, key_states, value_states)


def cache_hook(layout: KVShape, row_hook: RowHook) -> CacheHook:
    """Adapt a per-cached-tensor hook to transformers' update(key, value) arguments.

    gqa: row_hook(l, "k", K) and row_hook(l, "v", V). mla: the engine row [latent | k_rope] (engine
    order, see fake_quant.mla_row_to_engine) goes through row_hook(l, "kv", row) as one tensor.
    """
    if not layout.is_mla:
        def hook(layer_idx, key, value):
            return row_hook(layer_idx, "k", key), row_hook(layer_idx, "v", value)
        return hook

    def mla_hook(layer_idx, latent, k_rope):
        row = mla_row_to_engine(latent, k_rope, layout.rope_interleave)
        row = row_hook(layer_idx, "kv", row)
        return mla_row_from_engine(row, layout.kv_lora_rank, layout.rope_interleave)
    return mla_hook


def check_finite(layer_idx: int, kind: str, x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        what = {"k": "key", "v": "value", "kv": "MLA latent/k_rope"}[kind]
        raise KVConvertError(
            f"layer {layer_idx}: non-finite {what} activations during calibration (NaN or inf in the "
            "cached tensor); the checkpoint or the calibration data is broken at this layer")


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """AutoModelForCausalLM from a local safetensors folder, eval mode, no remote code.

    A kv-cache ``quantization_config`` in config.json (from an earlier calibration) is dropped so
    transformers builds the plain model; the k_scale/v_scale tensors are then unused extra keys.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:
        raise UnsupportedModelError(f"{model_dir}: transformers cannot read this config ({exc})") from None
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # extra k_scale/v_scale keys would print a long warning
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, config=config, dtype=dtype, trust_remote_code=False, use_safetensors=True)
    except (ValueError, KeyError, OSError) as exc:
        raise UnsupportedModelError(f"{model_dir}: transformers cannot load this model ({exc})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval()
    return model


def decoder_layers(model) -> list:
    """The decoder layers (each with .self_attn) of a causal LM."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"{type(model).__name__}: no model.layers; not a decoder-only LM kvconvert knows")
    return list(layers)


@torch.no_grad()
def forward_with_hook(model, ids: torch.Tensor, hook: CacheHook) -> torch.Tensor:
    """Logits [b, T, vocab] of one forward of ids [b, T] with a KVHookCache."""
    return model(input_ids=ids, past_key_values=KVHookCache(hook, config=model.config), use_cache=True).logits


def run_with_hook(model, windows: torch.Tensor, hook: CacheHook, batch_size: int = 1) -> None:
    """Forward every window ([N, T] token ids) with a KVHookCache, `batch_size` windows at a time."""
    for start in range(0, windows.shape[0], batch_size):
        forward_with_hook(model, windows[start:start + batch_size], hook)


class AttentionRecorder:
    """Records each attention module's call arguments for a chosen set of batches (forward pre-hook),
    so an attention block can be replayed later with a different cache hook (scale search).

    records[layer] is a list of kwargs dicts (hidden_states, position_embeddings, attention_mask, ...).
    """

    KEEP = ("hidden_states", "position_embeddings", "attention_mask", "position_ids", "cache_position")

    def __init__(self, model):
        self.layers = decoder_layers(model)
        self.records: list[list[dict]] = [[] for _ in self.layers]
        self.active = False
        self._handles = [
            layer.self_attn.register_forward_pre_hook(self._make_hook(i), with_kwargs=True)
            for i, layer in enumerate(self.layers)
        ]

    def _make_hook(self, index: int):
        def hook(module, args, kwargs):
            if self.active:
                if args:
                    raise UnsupportedModelError("attention called with positional arguments; cannot replay it")
                self.records[index].append({k: v for k, v in kwargs.items() if k in self.KEEP})
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @torch.no_grad()
    def replay(self, layer_idx: int, hook: CacheHook) -> list[torch.Tensor]:
        """Attention outputs (after o_proj) of layer `layer_idx` on every record, cache contents hooked."""
        attn = self.layers[layer_idx].self_attn
        return [attn(**rec, past_key_values=ReplayCache(hook))[0] for rec in self.records[layer_idx]]
