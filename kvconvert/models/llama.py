"""Llama (MHA / GQA; also Mistral without a sliding window): shapes from config.json, typed
attention weights (a layer is common.DecoderLayer), and the layer maths. The runtime
(kvconvert.runtime.models.llama) attends over its paged cache with these projections; the
converter, the streamed calibration and healing run the full-sequence functions below.

Per layer: h = x + o_proj(attn(rope(q), rope(k), v)) with x = rms_norm(h_in); out = h + mlp(rms_norm(h)).
RoPE uses transformers' rotate_half layout (pair f = dims (f, f + head_dim/2)).
Shapes: hidden states [B, T, hidden] (the runtime: [T, hidden]); weights nn.Linear-shaped [out, in].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvconvert.errors import UnsupportedModelError
from kvconvert.models.common import DecoderLayer, Rope, causal_attention, decoder_layer, decoder_settings, linear


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    rope: Rope  # over head_dim, rotate_half pairs
    layers: int = 0
    vocab: int = 0
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048

    @classmethod
    def from_config(cls, c: dict) -> LlamaShape:
        heads = c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        c = {"max_position_embeddings": 2048, **c}  # LlamaConfig's default
        return cls(hidden=c["hidden_size"], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   rope=Rope.from_config(c, head_dim), **decoder_settings(c))

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


@dataclass
class LlamaAttention:
    """q/k/v_proj [heads * head_dim or kv_heads * head_dim, hidden], o_proj [hidden, heads * head_dim]."""

    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_proj_bias: torch.Tensor | None = None
    k_proj_bias: torch.Tensor | None = None
    v_proj_bias: torch.Tensor | None = None
    o_proj_bias: torch.Tensor | None = None


def project_qkv(xn: torch.Tensor, a: LlamaAttention, s: LlamaShape):
    """Pre-RoPE q [..., T, H, d], k and v [..., T, G, d] from the normed input xn [..., T, hidden]."""
    q = linear(xn, a.q_proj, a.q_proj_bias).unflatten(-1, (s.heads, s.head_dim))
    k = linear(xn, a.k_proj, a.k_proj_bias).unflatten(-1, (s.kv_heads, s.head_dim))
    v = linear(xn, a.v_proj, a.v_proj_bias).unflatten(-1, (s.kv_heads, s.head_dim))
    return q, k, v


def qkv(xn: torch.Tensor, a: LlamaAttention, s: LlamaShape):
    """Post-RoPE q [B, H, T, d], k and v [B, G, T, d] for positions 0..T-1 of xn [B, T, hidden]:
    what the KV cache holds (k, v) and what reads it (q)."""
    q, k, v = project_qkv(xn, a, s)
    cos, sin = s.rope.table(xn.shape[-2], xn.device, xn.dtype)
    return s.rope(q, cos, sin).transpose(1, 2), s.rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: LlamaShape) -> torch.Tensor:
    """Per-head attention outputs before o_proj, [B, T, H * d], from post-RoPE q/k and v."""
    return causal_attention(q, k, v, s.scale).transpose(1, 2).flatten(-2)


def attention(xn: torch.Tensor, a: LlamaAttention, s: LlamaShape) -> torch.Tensor:
    """Attention block output (after o_proj) [B, T, hidden] for the normed input xn [B, T, hidden]."""
    return linear(attend(*qkv(xn, a, s), s), a.o_proj, a.o_proj_bias)


def layer(h: torch.Tensor, w: DecoderLayer, s: LlamaShape) -> torch.Tensor:
    """One decoder layer (w.attn a LlamaAttention) over the residual stream h [B, T, hidden]."""
    return decoder_layer(h, w, s, attention)
