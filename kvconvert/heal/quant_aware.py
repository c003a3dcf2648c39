"""Quantization-aware distillation: the student attends to its KV cache rounded as the engine will store
it, so healing also teaches it to live with the cache format's rounding noise.

What the engine caches per MLA token after `kvconvert calibrate --kv-dtype F`: the row [latent | k_rope]
(engine order, kvconvert.quant.fake_quant.mla_row_to_engine), except that where F rotates the latent
(4-bit formats) calibrate folds kv_a_layernorm's weight w into kv_b_proj and turns the rest by a block
Hadamard R (kvconvert.quant.rotate): the engine then stores R n with n = latent / w. So the training
forward replaces each cached row by

    row_q = w * (R^T fq(R n)) | k_rope rounded      (4-bit: rotated)
    row_q = fq([latent | k_rope])                   (fp8: not rotated)

with fq = kvconvert.quant.fake_quant.fake_quant_row (k_rope stays 16-bit or goes FP8 as F says)

with the row's scale from its amax (scale_from_amax, recomputed each forward: NVFP4's block scales
follow the data and its global scale only sets their range). The backward pass is straight through
(d row_q / d row = identity): the rounding is noise the other weights learn to absorb.

Not emulated: calibrate's mse scale search (it picks a slightly smaller scale than the amax) and its
per-RoPE-pair phases of k_rope (they reduce the FP8 k_rope's score noise a little); both only lower
the noise the engine sees.

The hook goes in through a forward pre-hook on every attention module (a stateless cache handed to
the attention as ``past_key_values``), so it also runs under gradient checkpointing, which drops
the model-level cache.
"""

from __future__ import annotations

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import kv_format
from kvconvert.kvmath import KVShape
from kvconvert.quant.capture import ReplayCache, cache_hook, decoder_layers
from kvconvert.quant.fake_quant import fake_quant_row, scale_from_amax


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """rounded in the forward pass, the identity in the backward pass."""
    return x + (rounded - x).detach()


def latent_rotation(layout: KVShape, kv_dtype: str) -> torch.Tensor | None:
    """The Hadamard `kvconvert calibrate` folds into the MLA latent for kv_dtype with its default
    settings on a checkpoint healed this way (no latent shaping: kvconvert.quant.run.keep_heal_basis),
    [rank, rank] float64, or None where it folds none."""
    from kvconvert.quant.calibrate import CalibrationSettings, hadamard

    return hadamard(layout, CalibrationSettings(kv_dtype), {})


@torch.no_grad()
def engine_rounding(row: torch.Tensor, norm_weight: torch.Tensor, rotation: torch.Tensor | None,
                    kv_dtype: str, rope_tail: int) -> torch.Tensor:
    """One MLA cache row [b, 1, T, rank + rope] (engine order) as the engine reads it back.

    norm_weight: kv_a_layernorm's weight [rank]; rotation: [rank, rank] float32 or None (then the row
    is stored as it is). Same shape and dtype out.
    """
    stored = row.float()
    if rotation is not None:
        stored = stored.clone()
        rank, w = norm_weight.numel(), norm_weight.float()
        stored[..., :rank] = (stored[..., :rank] / w) @ rotation.T  # n -> R n, row vectors
    rounded = fake_quant_row(stored, kv_dtype, scale_from_amax(stored.abs().amax(), kv_dtype), rope_tail)
    if rotation is not None:
        rounded[..., :rank] = (rounded[..., :rank] @ rotation) * w
    return rounded.to(row.dtype)


def quant_aware_hook(model, layout: KVShape, kv_dtype: str):
    """CacheHook (transformers' update(latent, k_rope) arguments) that rounds each MLA row as the engine
    stores it in kv_dtype, with a straight-through gradient."""
    if not layout.is_mla:
        raise KVConvertError("quantization-aware distillation emulates an MLA cache; the student is not MLA")
    rope_tail = kv_format(kv_dtype).rope_tail(layout.is_mla, layout.qk_rope_head_dim)
    weights = [layer.self_attn.kv_a_layernorm.weight for layer in decoder_layers(model)]
    rotation = latent_rotation(layout, kv_dtype)

    def row_hook(layer_idx: int, kind: str, row: torch.Tensor) -> torch.Tensor:
        w = weights[layer_idx].detach()
        r = None if rotation is None else rotation.to(device=row.device, dtype=torch.float32)
        return straight_through(row, engine_rounding(row, w, r, kv_dtype, rope_tail))
    return cache_hook(layout, row_hook)


def attach_cache_rounding(model, layout: KVShape, kv_dtype: str) -> list:
    """Make every attention module of `model` read its cache rounded in kv_dtype (quant_aware_hook).
    Returns the hook handles (call .remove() on each to detach)."""
    cache = ReplayCache(quant_aware_hook(model, layout, kv_dtype))

    def pre_hook(module, args, kwargs):
        return args, {**kwargs, "past_key_values": cache}
    return [layer.self_attn.register_forward_pre_hook(pre_hook, with_kwargs=True) for layer in decoder_layers(model)]
