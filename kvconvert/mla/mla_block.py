"""Functional DeepSeek-V3 MLA attention (expanded K/V form), matching transformers'
DeepseekV3Attention with q_lora_rank=None. Used to measure converted layers on calibration data.

Weights (checkpoint names without the layer prefix): q_proj [H*(nope+rope), hidden],
kv_a_proj_with_mqa [r + rope, hidden], kv_a_layernorm [r], kv_b_proj [H*(nope+v), r], o_proj [hidden, H*v].
RoPE on the rope dims uses interleaved pairs (2j, 2j+1) (rope_interleave=True, what `kvconvert mla`
writes) or rotate_half pairs (j, j + R/2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvconvert.mla.llama_block import apply_rope, attention_heads, rms_norm, rope_cos_sin


@dataclass(frozen=True)
class MLAShape:
    heads: int
    rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    latent_eps: float
    inv_freq: torch.Tensor  # [rope_dim / 2]
    attention_scaling: float = 1.0
    mscale: float = 1.0  # softmax-scale multiplier (yarn's mscale^2 in transformers' DeepseekV3Attention)
    rope_interleave: bool = True  # False: rotate_half pairs (j, j + rope_dim/2), as transformers without it

    @property
    def softmax_scale(self) -> float:
        return (self.nope_dim + self.rope_dim) ** -0.5 * self.mscale


def apply_rope_interleaved(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0):
    """x [..., T, R] with pairs (2j, 2j+1) rotated by inv_freq[j] * pos (complex multiply)."""
    ang = positions.to(x.device, torch.float64)[:, None] * inv_freq.to(x.device, torch.float64)[None, :]
    cos, sin = (ang.cos() * scaling).to(x.dtype), (ang.sin() * scaling).to(x.dtype)
    re, im = x[..., 0::2], x[..., 1::2]
    out = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1)
    return out.flatten(-2)


def mla_rope(x: torch.Tensor, s: MLAShape) -> torch.Tensor:
    """RoPE on the rope dims x [..., T, R] in the weights' pair layout (interleaved or rotate_half)."""
    positions = torch.arange(x.shape[-2])
    if s.rope_interleave:
        return apply_rope_interleaved(x, positions, s.inv_freq, s.attention_scaling)
    cos, sin = rope_cos_sin(positions.to(x.device), s.inv_freq, s.attention_scaling, x.dtype)
    return apply_rope(x, cos, sin)


def mla_latent(xn: torch.Tensor, w: dict, s: MLAShape):
    """Cached quantities: normed latent [B, T, r] and post-RoPE k_rope [B, T, R] (weights' pair order)."""
    kv = xn @ w["kv_a_proj_with_mqa"].T
    latent = rms_norm(kv[..., : s.rank], w["kv_a_layernorm"], s.latent_eps).to(xn.dtype)
    return latent, mla_rope(kv[..., s.rank:], s)


def mla_query(xn: torch.Tensor, w: dict, s: MLAShape) -> torch.Tensor:
    """Queries [B, H, T, nope + rope], RoPE applied to the rope part."""
    B, T, _ = xn.shape
    if "q_a_proj" in w:  # low-rank queries: q_b(RMSNorm(q_a x))
        q_lat = rms_norm(xn @ w["q_a_proj"].T, w["q_a_layernorm"], s.latent_eps).to(xn.dtype)
        q = q_lat @ w["q_b_proj"].T
    else:
        q = xn @ w["q_proj"].T
    q = q.view(B, T, s.heads, s.nope_dim + s.rope_dim).transpose(1, 2)
    return torch.cat([q[..., : s.nope_dim], mla_rope(q[..., s.nope_dim:], s)], dim=-1)


def mla_attend(q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, w: dict, s: MLAShape) -> torch.Tensor:
    """Per-head attention outputs before o_proj [B, T, H * v_dim] from the queries and the cached
    latent [B, T, r] / k_rope [B, T, R] (expanded per head with kv_b_proj, as transformers does)."""
    B, _, T, _ = q.shape
    kv = (latent @ w["kv_b_proj"].T).view(B, T, s.heads, s.nope_dim + s.v_dim).transpose(1, 2)
    k = torch.cat([kv[..., : s.nope_dim], k_rope[:, None].expand(B, s.heads, T, s.rope_dim)], dim=-1)
    out = attention_heads(q, k, kv[..., s.nope_dim:], s.softmax_scale)
    return out.transpose(1, 2).reshape(B, T, -1)


def mla_attention_heads(xn: torch.Tensor, w: dict, s: MLAShape) -> torch.Tensor:
    """Per-head attention outputs before o_proj: [B, T, H * v_dim]."""
    return mla_attend(mla_query(xn, w, s), *mla_latent(xn, w, s), w, s)


def mla_attention(xn: torch.Tensor, w: dict, s: MLAShape) -> torch.Tensor:
    return mla_attention_heads(xn, w, s) @ w["o_proj"].T
