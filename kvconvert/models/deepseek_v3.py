"""DeepSeek-V3 with Multi-head Latent Attention (MLA), dense MLP in every layer: shapes from
config.json, typed attention weights (a layer is common.DecoderLayer) and the layer maths. The
runtime (kvconvert.runtime.models.deepseek_v3) attends over its paged cache with these
projections; the converter, the streamed calibration and healing run the full-sequence functions
below.

Per token and layer the cache holds [c | k_rope], kv_lora_rank + qk_rope_head_dim values:
  c      = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank])       (the latent)
  k_rope = RoPE(kv_a_proj_with_mqa(x)[kv_lora_rank:])                (one head, shared by all)
kv_b_proj [H * (qk_nope + v_head), kv_lora_rank] expands c into per-head k_nope (W_UK) and v (W_UV);
queries are q_proj(x) or, with q_lora_rank, q_b_proj(q_a_layernorm(q_a_proj(x))).
Softmax scale: (qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 for yarn.
transformers builds kv_a_layernorm (and q_a_layernorm) with eps 1e-6 whatever rms_norm_eps says
(DeepseekV3RMSNorm's default); so does this. rope_interleave=True (what `kvconvert mla` writes)
rotates pairs (2i, 2i+1) and keeps that layout in the cache (vLLM's layout); False rotates
pairs (i, i + R/2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvconvert.errors import UnsupportedModelError
from kvconvert.models.common import (DecoderLayer, Rope, causal_attention, decoder_layer, decoder_settings, linear,
                                     rms_norm, rope_parameters, yarn_softmax_scale)

LATENT_NORM_EPS = 1e-6  # transformers: DeepseekV3RMSNorm(kv_lora_rank) -> default eps


@dataclass(frozen=True)
class MLAShape:
    heads: int
    rank: int  # kv_lora_rank
    rope_dim: int  # qk_rope_head_dim
    nope_dim: int  # qk_nope_head_dim
    v_dim: int  # v_head_dim
    rope: Rope  # over rope_dim, pair layout from rope_interleave
    softmax_scale: float
    rms_eps: float = 1e-6  # the decoder norms' eps
    latent_eps: float = LATENT_NORM_EPS
    layers: int = 0
    vocab: int = 0
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096

    @classmethod
    def from_config(cls, c: dict) -> MLAShape:
        c = {"max_position_embeddings": 4096, **c}  # DeepseekV3Config's default
        nope, rope = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        rotary = Rope.from_config(c, rope, interleaved=bool(c.get("rope_interleave", True)))
        return cls(heads=c["num_attention_heads"], rank=c["kv_lora_rank"], rope_dim=rope, nope_dim=nope,
                   v_dim=c["v_head_dim"], rope=rotary,
                   softmax_scale=yarn_softmax_scale(rope_parameters(c), (nope + rope) ** -0.5), **decoder_settings(c))


def check_dense(c: dict) -> None:
    """Refuse MoE layers: every kvconvert path computes dense DeepSeek-V3 layers only."""
    layers, dense = c["num_hidden_layers"], c.get("first_k_dense_replace", 3)
    if dense is not None and dense < layers and (c.get("n_routed_experts") or 0) > 0:
        raise UnsupportedModelError(
            f"layers {dense}..{layers - 1} are MoE (first_k_dense_replace={dense}); kvconvert runs dense "
            "DeepSeek-V3 only (kvconvert mla writes first_k_dense_replace = num_hidden_layers)")


@dataclass
class MLAAttention:
    """q_proj [H * (nope + rope), hidden] or q_a_proj [q_rank, hidden] + q_a_layernorm [q_rank] +
    q_b_proj [H * (nope + rope), q_rank]; kv_a_proj_with_mqa [rank + rope, hidden]; kv_a_layernorm
    [rank]; kv_b_proj [H * (nope + v), rank]; o_proj [hidden, H * v]."""

    kv_a_proj_with_mqa: torch.Tensor
    kv_a_layernorm: torch.Tensor
    kv_b_proj: torch.Tensor
    o_proj: torch.Tensor
    q_proj: torch.Tensor | None = None
    q_a_proj: torch.Tensor | None = None
    q_a_layernorm: torch.Tensor | None = None
    q_b_proj: torch.Tensor | None = None
    q_a_proj_bias: torch.Tensor | None = None
    kv_a_proj_with_mqa_bias: torch.Tensor | None = None
    o_proj_bias: torch.Tensor | None = None

    def absorbed(self, s: MLAShape) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v, rank]: strided views of kv_b_proj (no copy)."""
        per_head = self.kv_b_proj.view(s.heads, s.nope_dim + s.v_dim, s.rank)
        return per_head[:, : s.nope_dim], per_head[:, s.nope_dim:]


def project_queries(xn: torch.Tensor, a: MLAAttention, s: MLAShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE q_nope [..., T, H, nope] and q_rope [..., T, H, rope] from xn [..., T, hidden]."""
    if a.q_a_proj is None:
        q = linear(xn, a.q_proj)
    else:  # low-rank queries: q_b(RMSNorm(q_a x))
        q = linear(rms_norm(linear(xn, a.q_a_proj, a.q_a_proj_bias), a.q_a_layernorm, s.latent_eps), a.q_b_proj)
    return q.unflatten(-1, (s.heads, s.nope_dim + s.rope_dim)).split([s.nope_dim, s.rope_dim], dim=-1)


def project_latent(xn: torch.Tensor, a: MLAAttention, s: MLAShape) -> tuple[torch.Tensor, torch.Tensor]:
    """The normed latent [..., T, rank] and pre-RoPE k_rope [..., T, rope] from xn [..., T, hidden]."""
    latent, k_rope = linear(xn, a.kv_a_proj_with_mqa, a.kv_a_proj_with_mqa_bias).split([s.rank, s.rope_dim], dim=-1)
    return rms_norm(latent, a.kv_a_layernorm, s.latent_eps), k_rope


def expand(latent: torch.Tensor, a: MLAAttention, s: MLAShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head k_nope [..., S, H, nope] and v [..., S, H, v] from cached latents [..., S, rank]."""
    kv = linear(latent, a.kv_b_proj).unflatten(-1, (s.heads, s.nope_dim + s.v_dim))
    return kv.split([s.nope_dim, s.v_dim], dim=-1)


def query(xn: torch.Tensor, a: MLAAttention, s: MLAShape) -> torch.Tensor:
    """Queries [B, H, T, nope + rope] for positions 0..T-1, RoPE applied to the rope part."""
    q_nope, q_rope = project_queries(xn, a, s)
    cos, sin = s.rope.table(xn.shape[-2], xn.device, xn.dtype)
    return torch.cat([q_nope, s.rope(q_rope, cos, sin)], dim=-1).transpose(1, 2)


def latent(xn: torch.Tensor, a: MLAAttention, s: MLAShape) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache holds: normed latent [B, T, rank] and post-RoPE k_rope [B, T, rope] (weights' pair order)."""
    c, k_rope = project_latent(xn, a, s)
    cos, sin = s.rope.table(xn.shape[-2], xn.device, xn.dtype)
    return c.to(xn.dtype), s.rope(k_rope, cos[:, 0], sin[:, 0])


def attend(q: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor, a: MLAAttention, s: MLAShape) -> torch.Tensor:
    """Per-head attention outputs before o_proj [B, T, H * v] from the queries [B, H, T, nope + rope]
    and the cached latent [B, T, rank] / k_rope [B, T, rope], expanded per head (as transformers does)."""
    k_nope, v = expand(c, a, s)
    k = torch.cat([k_nope, k_rope[:, :, None].expand(*k_nope.shape[:-1], s.rope_dim)], dim=-1)
    out = causal_attention(q, k.transpose(1, 2), v.transpose(1, 2), s.softmax_scale)
    return out.transpose(1, 2).flatten(-2)


def attention_heads(xn: torch.Tensor, a: MLAAttention, s: MLAShape) -> torch.Tensor:
    """Per-head attention outputs before o_proj [B, T, H * v] for the normed input xn [B, T, hidden]."""
    return attend(query(xn, a, s), *latent(xn, a, s), a, s)


def attention(xn: torch.Tensor, a: MLAAttention, s: MLAShape) -> torch.Tensor:
    """Attention block output (after o_proj) [B, T, hidden]."""
    return linear(attention_heads(xn, a, s), a.o_proj, a.o_proj_bias)


def layer(h: torch.Tensor, w: DecoderLayer, s: MLAShape) -> torch.Tensor:
    """One dense decoder layer (w.attn an MLAAttention) over the residual stream h [B, T, hidden]."""
    return decoder_layer(h, w, s, attention)
