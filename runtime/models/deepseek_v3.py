"""DeepSeek-V3 decoder with Multi-head Latent Attention (MLA), dense MLP in every layer.

Per token and layer the cache holds one row [c | k_rope] of kv_lora_rank + qk_rope_head_dim values:
  c      = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank])       (the latent)
  k_rope = RoPE(kv_a_proj_with_mqa(x)[kv_lora_rank:])                (one head, shared by all)
kv_b_proj [H * (qk_nope + v_head), kv_lora_rank] expands c into per-head k_nope (W_UK) and v (W_UV).

Two equivalent ways to attend (vLLM's MLA scheme):
  * prefill (multi-token chunks): expand the context's latents to per-head K = [k_nope | k_rope]
    and V, then ordinary attention: compute-efficient when many queries share the expansion.
  * decode (one token): absorb W_UK into the query, q_lat[h] = q_nope[h] @ W_UK[h] (kv_lora_rank
    values), so scores are [q_lat | q_rope] . [c | k_rope] against the cached rows directly (MQA,
    one KV head); the output stays in latent space, o_lat = softmax @ c, and W_UV maps it back:
    o[h] = W_UV[h] @ o_lat[h]. Only the small rows are read: the point of MLA.
Softmax scale: (qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 for yarn.
transformers builds kv_a_layernorm (and q_a_layernorm) with eps 1e-6 whatever rms_norm_eps says
(DeepseekV3RMSNorm's default); this does the same. rope_interleave=True rotates pairs (2i, 2i+1)
and keeps that layout in the cache (vLLM's layout); transformers de-interleaves q and k alike, so
the scores are the same.
"""

from __future__ import annotations

import torch
from kvconvert.runtime.attention import AttentionMetadata, causal_mask
from kvconvert.runtime.kv_cache import CacheSpec
from kvconvert.runtime.layers import (
    GatedMLP,
    Rotary,
    final_norm,
    fp32_logits,
    linear,
    load_decoder,
    rms_norm,
    rope_parameters,
    yarn_softmax_scale,
)

from kvconvert.errors import UnsupportedModelError

LATENT_NORM_EPS = 1e-6  # transformers: DeepseekV3RMSNorm(kv_lora_rank) -> default eps


class DeepseekV3Layer:
    def __init__(self, w: dict[str, torch.Tensor], m: DeepseekV3ForCausalLM):
        self.input_norm = w["input_layernorm.weight"]
        self.post_norm = w["post_attention_layernorm.weight"]
        kv_a = w["self_attn.kv_a_proj_with_mqa.weight"]  # [rank + rope, hidden]
        kv_a_bias = w.get("self_attn.kv_a_proj_with_mqa.bias")
        # q (or q_a) and kv_a read the same input but stay separate tensors: no fused copy of
        # weights mapped from the checkpoint
        self.kv_a, self.kv_a_bias = kv_a, kv_a_bias
        if m.q_lora_rank is None:
            self.q, self.q_bias = w["self_attn.q_proj.weight"], None
            self.q_a = None
        else:
            self.q_a, self.q_a_bias = w["self_attn.q_a_proj.weight"], w.get("self_attn.q_a_proj.bias")
            self.q_a_norm = w["self_attn.q_a_layernorm.weight"]
            self.q_b = w["self_attn.q_b_proj.weight"]
        self.kv_a_norm = w["self_attn.kv_a_layernorm.weight"]
        kv_b = w["self_attn.kv_b_proj.weight"]  # [H * (nope + v), rank]
        self.kv_b = kv_b
        per_head = kv_b.view(m.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.w_uk = per_head[:, : m.qk_nope_head_dim]  # [H, nope, rank] (strided views of kv_b: no copy)
        self.w_uv = per_head[:, m.qk_nope_head_dim:]  # [H, v, rank]
        self.o = w["self_attn.o_proj.weight"]
        self.o_bias = w.get("self_attn.o_proj.bias")
        self.mlp = GatedMLP(w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"], m.hidden_act)


class DeepseekV3ForCausalLM:
    """Weights as plain tensors; forward(input_ids [T], positions [T], ...) -> hidden [T, hidden].
    dtype: as LlamaForCausalLM's (weights mapped when stored in it; norms, softmax, logits fp32)."""

    architecture = "deepseek_v3"

    def __init__(self, reader, dtype: torch.dtype = torch.float32, max_positions: int | None = None):
        c = reader.config
        self.config = c
        self.hidden_size = c["hidden_size"]
        self.num_heads = c["num_attention_heads"]
        self.num_layers = c["num_hidden_layers"]
        self.vocab_size = c["vocab_size"]
        self.q_lora_rank = c.get("q_lora_rank")
        self.kv_lora_rank = c["kv_lora_rank"]
        self.qk_nope_head_dim = c["qk_nope_head_dim"]
        self.qk_rope_head_dim = c["qk_rope_head_dim"]
        self.v_head_dim = c["v_head_dim"]
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.hidden_act = c.get("hidden_act", "silu")
        self.max_position_embeddings = c.get("max_position_embeddings", 4096)
        self._check_dense(c)
        params = rope_parameters(c)
        self.scale = yarn_softmax_scale(params, (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)
        self.rotary = Rotary(self.qk_rope_head_dim, params, self.max_position_embeddings,
                             max_positions or self.max_position_embeddings,
                             interleaved=bool(c.get("rope_interleave", True)), dtype=dtype)
        self.dtype = dtype
        self._load(reader, dtype)

    def _check_dense(self, c: dict) -> None:
        dense = c.get("first_k_dense_replace", 3)
        if dense is not None and dense < self.num_layers and (c.get("n_routed_experts") or 0) > 0:
            raise UnsupportedModelError(
                f"layers {dense}..{self.num_layers - 1} are MoE (first_k_dense_replace={dense}); the runtime runs "
                "dense DeepSeek-V3 only (kvconvert writes first_k_dense_replace = num_hidden_layers)"
            )

    def _load(self, reader, dtype):
        self.embed, self.norm, self.lm_head, self.layers = load_decoder(
            reader, dtype, self.num_layers, lambda w: DeepseekV3Layer(w, self))

    # ---------------------------------------------------------------- cache layout
    def kv_layout(self) -> list[dict[str, CacheSpec]]:
        return self.layout_from_config(self.config)

    @staticmethod
    def layout_from_config(c: dict) -> list[dict[str, CacheSpec]]:
        """Per layer: one row [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)] per token."""
        row = CacheSpec((c["kv_lora_rank"] + c["qk_rope_head_dim"],), rope_tail=c["qk_rope_head_dim"])
        return [{"kv": row} for _ in range(c["num_hidden_layers"])]

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, meta: AttentionMetadata,
                attn) -> torch.Tensor:
        x = self.embed[input_ids].to(self.dtype)
        angles = self.rotary.angles(positions)
        for layer, stores in zip(self.layers, cache.layers):
            x = x + self._attention(layer, rms_norm(x, layer.input_norm, self.eps), angles, stores["kv"], meta, attn)
            x = x + layer.mlp(rms_norm(x, layer.post_norm, self.eps))
        return final_norm(x, self.norm, self.eps)

    def _queries_and_rows(self, layer: DeepseekV3Layer, x, angles):
        """-> q_nope [T, H, nope], q_rope [T, H, rope] (RoPE'd), rows [T, rank + rope] to cache."""
        t, h = x.shape[0], self.num_heads
        rank, rope = self.kv_lora_rank, self.qk_rope_head_dim
        kv_a = linear(x, layer.kv_a, layer.kv_a_bias)
        if layer.q_a is None:
            q = linear(x, layer.q, layer.q_bias)
        else:
            q_a = linear(x, layer.q_a, layer.q_a_bias)
            q = linear(rms_norm(q_a, layer.q_a_norm, LATENT_NORM_EPS), layer.q_b)
        q = q.view(t, h, self.qk_nope_head_dim + rope)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, rope], dim=-1)
        latent, k_rope = kv_a.split([rank, rope], dim=-1)
        latent = rms_norm(latent, layer.kv_a_norm, LATENT_NORM_EPS)
        q_rope = self.rotary(q_rope, angles)
        k_rope = self.rotary(k_rope[:, None, :], angles)[:, 0]
        return q_nope, q_rope, torch.cat([latent, k_rope], dim=-1)

    def _attention(self, layer: DeepseekV3Layer, x, angles, store, meta, attn):
        t = x.shape[0]
        q_nope, q_rope, rows = self._queries_and_rows(layer, x, angles)
        attn.write(store, rows, meta)
        out = x.new_empty(t, self.num_heads, self.v_head_dim)
        nd = meta.num_decode
        if nd:
            out[:nd] = self._decode(layer, q_nope[:nd], q_rope[:nd], store, meta, attn)
        for c in meta.prefills:
            span = slice(c.query_start, c.query_start + c.query_len)
            out[span] = self._prefill(layer, q_nope[span], q_rope[span], attn.read_rows(store, c, x.dtype), c)
        return linear(out.reshape(t, -1), layer.o, layer.o_bias)

    def _decode(self, layer, q_nope, q_rope, store, meta, attn):
        """Absorbed: [B, H, nope] x W_UK -> latent queries; out_lat [B, H, rank] x W_UV -> [B, H, v]."""
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, layer.w_uk)
        out_lat = attn.mla_decode(torch.cat([q_lat, q_rope], dim=-1), store, meta, self.scale, self.kv_lora_rank)
        return torch.einsum("bhr,hvr->bhv", out_lat, layer.w_uv)

    def _prefill(self, layer, q_nope, q_rope, rows, chunk):
        """Expanded: context rows [S, rank + rope] -> per-head K [H, S, nope + rope], V [H, S, v]."""
        s, h = rows.shape[0], self.num_heads
        kv = linear(rows[:, : self.kv_lora_rank], layer.kv_b).view(s, h, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rope = rows[:, None, self.kv_lora_rank:].expand(s, h, self.qk_rope_head_dim)
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(0, 1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)
        mask = None if chunk.query_len == chunk.context_len else causal_mask(chunk.query_len, chunk.context_len)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v.transpose(0, 1), attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return o.transpose(0, 1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (already normed, fp32) -> fp32 logits [N, vocab]."""
        return fp32_logits(hidden, self.lm_head)
