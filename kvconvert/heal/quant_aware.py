"""Quantization-aware distillation: the student attends to its KV cache rounded as the engine will store
it, so healing also teaches it to live with the cache format's rounding noise.

Any student: an MLA conversion or a model with the teacher's own per-head K/V (a Llama/GQA source healed
for its cache). Three kinds of format:

* llama.cpp's block types (q8_0, q4_0, q5_0, iq4_nl, ...; kvconvert.ggml_formats), one for both halves or a
  K/V pair KTYPE/VTYPE (q5_0/iq4_nl: -ctk q5_0 -ctv iq4_nl; per-head K/V only): the cache as the engine
  stores the checkpoint it is given, through the runtime's own bit-exact frames (kvconvert.quant.hooks.
  llamacpp_hook: per-head K in llama.cpp's interleaved RoPE order and Hadamard, V's Hadamard, the MLA row
  [latent | k_rope] whole and unrotated). Each block's fp16 scale follows the data, so nothing is calibrated
  afterwards: the healed checkpoint (or its GGUF) is what llama.cpp serves with the stock flags.
* Per-head K/V in a scaled format (fp8, int8, nvfp4): each tensor at its amax scale per forward, as calibrate
  stores it per tensor (int8: K and V at one shared scale; nvfp4: V turned by calibrate's Hadamard).
* An MLA row in a scaled format, below.

MLA in a scaled format:

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

Not emulated: calibrate's mse scale search (it picks a slightly smaller scale than the amax), its
per-RoPE-pair phases of the keys (they reduce the FP8 keys' score noise a little) and, for llama.cpp's
per-head K, the key pair balance it may fold (exact in 16 bits); all only lower the noise the engine sees.

The hook goes in through a forward pre-hook on every attention module (a stateless cache handed to
the attention as ``past_key_values``), so it also runs under gradient checkpointing, which drops
the model-level cache.
"""

from __future__ import annotations

import torch

from kvconvert.kvformat import KVPair, kv_format, kv_pair
from kvconvert.kvmath import KVShape
from kvconvert.quant.capture import CacheHook, ReplayCache, cache_hook, decoder_layers
from kvconvert.quant.fake_quant import check_kv_dtype, fake_quant_row, scale_from_amax
from kvconvert.quant.hooks import llamacpp_hook


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """rounded in the forward pass, the identity in the backward pass."""
    return x + (rounded - x).detach()


def latent_rotation(layout: KVShape, kv_dtype: str) -> torch.Tensor | None:
    """The Hadamard `kvconvert calibrate` folds into the MLA latent (per-head V) for kv_dtype with its default
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


def quant_aware_hook(model, layout: KVShape, kv_dtype: str) -> CacheHook:
    """CacheHook (transformers' update(key, value) arguments) that rounds what the engine caches as it stores it
    in kv_dtype, with a straight-through gradient (module docstring for the three kinds of format)."""
    if check_quant_aware_dtype(kv_dtype, layout).ggml_types:  # llama.cpp's K and V types (one or a pair)
        return straight_through_hook(llamacpp_hook(layout, kv_dtype))
    if not layout.is_mla:
        return straight_through_hook(scaled_per_head_hook(layout, kv_dtype))
    rope_tail = kv_format(kv_dtype).rope_tail(layout.is_mla, layout.qk_rope_head_dim)
    weights = [layer.self_attn.kv_a_layernorm.weight for layer in decoder_layers(model)]
    rotation = latent_rotation(layout, kv_dtype)

    def row_hook(layer_idx: int, kind: str, row: torch.Tensor) -> torch.Tensor:
        w = weights[layer_idx].detach()
        r = None if rotation is None else rotation.to(device=row.device, dtype=torch.float32)
        return straight_through(row, engine_rounding(row, w, r, kv_dtype, rope_tail))
    return cache_hook(layout, row_hook)


def check_quant_aware_dtype(kv_dtype: str, layout: KVShape | None = None) -> KVPair:
    """The K/V formats of a heal_distill.kv_dtype, refused by name where the student cannot be served with them (an
    MLA-only layout or a mixed pair for the cache kind; a shape llama.cpp refuses for its block types:
    targets.llamacpp_shape_problem)."""
    from kvconvert.targets import check_llamacpp_shape

    pair = kv_pair(kv_dtype)  # one format, or llama.cpp's K/V pair KTYPE/VTYPE
    for half in {pair.k.name, pair.v.name}:
        check_kv_dtype(half)  # a format calibrate stores (quantized)
    if layout is not None:
        pair.check_cache_kind(layout.is_mla)
        # llama.cpp's servable shapes, the one rule every command asks: a heal for a cache it refuses would teach
        # the model a cache no engine serves
        check_llamacpp_shape(pair.name, layout.is_mla, head_dim=layout.head_dim or 0,
                             rank=layout.kv_lora_rank or 0, rope_dim=layout.qk_rope_head_dim or 0)
    return pair


def straight_through_hook(rounding: CacheHook) -> CacheHook:
    """`rounding`'s cache in the forward pass (computed without a graph), the identity in the backward pass."""
    def hook(layer_idx, key, value):
        with torch.no_grad():
            k_q, v_q = rounding(layer_idx, key.detach(), value.detach())
        return straight_through(key, k_q), straight_through(value, v_q)
    return hook


def scaled_per_head_hook(layout: KVShape, kv_dtype: str) -> CacheHook:
    """Per-head K/V [b, kv_heads, T, head_dim] rounded in a scaled format at this forward's amax per tensor (calibrate's
    default granularity); int8 stores K and V at one scale (their max); nvfp4's V is turned by the Hadamard calibrate
    folds into v_proj / o_proj (stored R v, read back R^T)."""
    fmt = kv_format(kv_dtype)
    rotation = latent_rotation(layout, kv_dtype)  # the value Hadamard for per-head K/V

    def hook(layer_idx, key, value):
        r = None if rotation is None else rotation.to(value.device, torch.float32)
        stored_v = value.float() if r is None else value.float() @ r.T  # what the cache holds (R v)
        k_scale, v_scale = fmt.engine_scales(scale_from_amax(key.float().abs().amax(), kv_dtype),
                                             scale_from_amax(stored_v.abs().amax(), kv_dtype))
        k_q = fake_quant_row(key, kv_dtype, k_scale)
        if r is None:
            return k_q, fake_quant_row(value, kv_dtype, v_scale)
        return k_q, (fake_quant_row(stored_v, kv_dtype, v_scale) @ r).to(value.dtype)
    return hook


def attach_cache_rounding(model, layout: KVShape, kv_dtype: str) -> list:
    """Make every attention module of `model` read its cache rounded in kv_dtype (quant_aware_hook).
    Returns the hook handles (call .remove() on each to detach)."""
    cache = ReplayCache(quant_aware_hook(model, layout, kv_dtype))

    def pre_hook(module, args, kwargs):
        return args, {**kwargs, "past_key_values": cache}
    return [layer.self_attn.register_forward_pre_hook(pre_hook, with_kwargs=True) for layer in decoder_layers(model)]
