"""DeepSeek-V3 decoder with Multi-head Latent Attention (MLA) over the paged KV cache, dense MLP in
every layer. The shape, weights and per-layer maths are kvconvert.models.deepseek_v3's (see its
docstring for the cached row [c | k_rope]); this adds the two ways to attend (vLLM's MLA scheme):
  * prefill (multi-token chunks): expand the context's latents to per-head K = [k_nope | k_rope]
    and V, then ordinary attention: compute-efficient when many queries share the expansion.
  * decode (one token): absorb W_UK into the query, q_lat[h] = q_nope[h] @ W_UK[h] (kv_lora_rank
    values), so scores are [q_lat | q_rope] . [c | k_rope] against the cached rows directly (MQA,
    one KV head); the output stays in latent space, o_lat = softmax @ c, and W_UV maps it back:
    o[h] = W_UV[h] @ o_lat[h]. Only the small rows are read: the point of MLA.
"""

from __future__ import annotations

import torch

from kvconvert.models import deepseek_v3 as ds
from kvconvert.models.common import linear
from kvconvert.runtime.attention import AttentionMetadata, causal_sdpa
from kvconvert.runtime.layers import Decoder


class DeepseekV3ForCausalLM(Decoder):
    """Weights as plain tensors; forward(input_ids [T], positions [T], ...) -> hidden [T, hidden].
    dtype: as LlamaForCausalLM's (weights mapped when stored in it; norms, softmax, logits fp32)."""

    shape_cls, attention_cls = ds.MLAShape, ds.MLAAttention

    def __init__(self, reader, dtype: torch.dtype = torch.float32, max_positions: int | None = None, device="cpu"):
        ds.check_dense(reader.config)
        super().__init__(reader, dtype, max_positions, device)

    def attention(self, a: ds.MLAAttention, x, angles, cache, meta: AttentionMetadata, attn):
        """x [T, hidden] normed -> attention block output [T, hidden], through the layer's paged cache."""
        s = self.shape
        q_nope, q_rope = ds.project_queries(x, a, s)
        latent, k_rope = ds.project_latent(x, a, s)
        q_rope = s.rope(q_rope, *angles)
        attn.write(cache, latent, s.rope(k_rope[:, None, :], *angles)[:, 0], meta)
        out = x.new_empty(x.shape[0], s.heads, s.v_dim)
        nd = meta.num_decode
        if nd:
            out[:nd] = self._decode(a, q_nope[:nd], q_rope[:nd], cache, meta, attn)
        for c in meta.prefills:
            span = slice(c.query_start, c.query_start + c.query_len)
            out[span] = self._prefill(a, q_nope[span], q_rope[span], attn.read_rows(cache, c, x.dtype), c)
        return linear(out.flatten(-2), a.o_proj, a.o_proj_bias)

    def _decode(self, a, q_nope, q_rope, cache, meta, attn):
        """Absorbed: [B, H, nope] x W_UK -> latent queries; out_lat [B, H, rank] x W_UV -> [B, H, v]."""
        w_uk, w_uv = a.absorbed(self.shape)
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        out_lat = attn.mla_decode(torch.cat([q_lat, q_rope], dim=-1), cache, meta, self.shape.softmax_scale,
                                  self.shape.rank)
        return torch.einsum("bhr,hvr->bhv", out_lat, w_uv)

    def _prefill(self, a, q_nope, q_rope, rows, chunk):
        """Expanded: context rows [S, rank + rope] -> per-head K [H, S, nope + rope], V [H, S, v]."""
        s = self.shape
        k_nope, v = ds.expand(rows[:, : s.rank], a, s)
        k_rope = rows[:, None, s.rank:].expand(rows.shape[0], s.heads, s.rope_dim)
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(0, 1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)
        o = causal_sdpa(q, k, v.transpose(0, 1), chunk.query_len, chunk.context_len, s.softmax_scale)  # [H, L, v]
        return o.transpose(0, 1)
