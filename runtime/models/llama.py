"""Llama-family decoder (MHA / GQA) over the paged KV cache.

The shape, weights and per-layer maths are kvconvert.models.llama's; this adds the paged cache:
it holds post-RoPE k and v per KV head, "k", "v" rows [kv_heads, head_dim]. Matches transformers'
LlamaForCausalLM (same norms, casts and RoPE), including attention/MLP biases when present and
tied embeddings when lm_head.weight is absent.
"""

from __future__ import annotations

import torch

from kvconvert.models import llama
from kvconvert.models.common import linear
from kvconvert.runtime.attention import AttentionMetadata
from kvconvert.runtime.layers import Decoder


class LlamaForCausalLM(Decoder):
    """Weights as plain tensors; forward(input_ids [T], positions [T], ...) -> hidden [T, hidden].

    dtype: the weights' and activations' dtype. Weights already stored in it are views of the
    checkpoint's files (mapped, not copied); others are converted copies. RMSNorm statistics and
    softmax run in fp32, the final norm and the logits entirely in fp32 (see fp32_logits).
    """

    shape_cls, attention_cls = llama.LlamaShape, llama.LlamaAttention

    def attention(self, a: llama.LlamaAttention, x, angles, cache, meta: AttentionMetadata, attn):
        """x [T, hidden] normed -> attention block output [T, hidden], through the layer's paged cache."""
        q, k, v = llama.project_qkv(x, a, self.shape)
        attn.write(cache, self.shape.rope(k, *angles), v, meta)
        out = attn.gqa(self.shape.rope(q, *angles), cache, meta, self.shape.scale)
        return linear(out.flatten(-2), a.o_proj, a.o_proj_bias)
