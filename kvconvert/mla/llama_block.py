"""Functional Llama decoder layer (fp32/fp64), used to stream calibration activations layer by
layer without building the whole model. Matches transformers' LlamaDecoderLayer numerics
(rotate_half RoPE layout: pair f = dims (f, f + head_dim/2)).

Shapes: hidden [B, T, hidden]; per-layer weights as in the checkpoint (nn.Linear: [out, in]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    inv_freq: torch.Tensor  # [head_dim/2] float64, scaled by the source's rope_parameters
    attention_scaling: float = 1.0  # cos/sin multiplier (yarn); 1.0 for default/llama3

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float() if x.dtype != torch.float64 else x
    return weight.to(x32.dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0, dtype=torch.float32):
    """cos, sin of shape [T, 2 * len(inv_freq)] in transformers' rotate_half layout."""
    freqs = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device, torch.float64)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d] (rotate_half layout), cos/sin [T, d]."""
    return x * cos + rotate_half(x) * sin


def project_qkv(xn: torch.Tensor, w: dict, s: LlamaShape):
    """Pre-RoPE q [B, H, T, d], k and v [B, G, T, d] from normed input xn [B, T, hidden]."""
    B, T, _ = xn.shape
    q = (xn @ w["q_proj"].T).view(B, T, s.heads, s.head_dim).transpose(1, 2)
    k = (xn @ w["k_proj"].T).view(B, T, s.kv_heads, s.head_dim).transpose(1, 2)
    v = (xn @ w["v_proj"].T).view(B, T, s.kv_heads, s.head_dim).transpose(1, 2)
    return q, k, v


def attention_heads(q, k, v, scale: float) -> torch.Tensor:
    """Causal attention with GQA expansion: q [B, H, T, dq], k [B, G, T, dq], v [B, G, T, dv] -> [B, H, T, dv]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    dq, dv = q.shape[-1], v.shape[-1]
    # PyTorch's fused CPU kernel needs equal q/k and v head dims (else a 10x slower fallback):
    # zero-padding v (or q and k) changes neither the scores nor the kept output columns.
    if dv < dq:
        v = F.pad(v, (0, dq - dv))
    elif dq < dv:
        q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out[..., :dv]


def llama_qkv(xn: torch.Tensor, w: dict, s: LlamaShape):
    """Post-RoPE q [B, H, T, d], k and v [B, G, T, d]: what the KV cache holds (k, v) and what reads it."""
    q, k, v = project_qkv(xn, w, s)
    cos, sin = rope_cos_sin(torch.arange(xn.shape[1], device=xn.device), s.inv_freq, s.attention_scaling, xn.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def llama_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: LlamaShape) -> torch.Tensor:
    """Per-head attention outputs before o_proj, [B, T, H * d], from post-RoPE q/k and v."""
    B, _, T, _ = q.shape
    return attention_heads(q, k, v, s.head_dim ** -0.5).transpose(1, 2).reshape(B, T, -1)


def llama_attention(xn: torch.Tensor, w: dict, s: LlamaShape) -> torch.Tensor:
    """Attention block output (after o_proj) [B, T, hidden] for normed input xn."""
    return llama_attend(*llama_qkv(xn, w, s), s) @ w["o_proj"].T


def _mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in x's dtype (weights may be stored in bf16 to save memory)."""
    return x @ weight.to(x.dtype).T


def llama_mlp(xn: torch.Tensor, w: dict) -> torch.Tensor:
    return _mm(F.silu(_mm(xn, w["gate_proj"])) * _mm(xn, w["up_proj"]), w["down_proj"])


def llama_layer(h: torch.Tensor, w: dict, s: LlamaShape) -> torch.Tensor:
    """One decoder layer: h + attn(norm(h)), then + mlp(norm(.)). w keys: short names (q_proj, ...)."""
    attn_w = {k: w[k].to(h.dtype) for k in ("q_proj", "k_proj", "v_proj", "o_proj")}
    h = h + llama_attention(rms_norm(h, w["input_layernorm"], s.rms_eps), attn_w, s)
    return h + llama_mlp(rms_norm(h, w["post_attention_layernorm"], s.rms_eps), w)
