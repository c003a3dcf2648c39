"""Llama-family decoder (MHA / GQA) over the paged KV cache.

Per layer: h = x + o_proj(attn(rope(q), rope(k), v)); out = h + mlp(rmsnorm(h)). The cache holds
post-RoPE k and v per KV head: "k", "v" rows [kv_heads, head_dim]. Matches transformers'
LlamaForCausalLM (same norms, casts and RoPE), including attention/MLP biases when present and
tied embeddings when lm_head.weight is absent.
"""

from __future__ import annotations

import torch
from kvconvert.runtime.attention import AttentionMetadata
from kvconvert.runtime.kv_cache import CacheSpec
from kvconvert.runtime.layers import (GatedMLP, Rotary, final_norm, fp32_logits, linear, load_decoder, rms_norm,
                                      rope_parameters)

from kvconvert.errors import UnsupportedModelError


class LlamaLayer:
    def __init__(self, w: dict[str, torch.Tensor], cfg: LlamaForCausalLM):
        self.input_norm = w["input_layernorm.weight"]
        self.post_norm = w["post_attention_layernorm.weight"]
        # q, k, v stay three tensors (no fused copy of weights mapped from the checkpoint)
        self.qkv = [(w[f"self_attn.{p}_proj.weight"], w.get(f"self_attn.{p}_proj.bias")) for p in "qkv"]
        self.o = w["self_attn.o_proj.weight"]
        self.o_bias = w.get("self_attn.o_proj.bias")
        mlp_biases = tuple(w.get(f"mlp.{p}_proj.bias") for p in ("gate", "up", "down"))
        self.mlp = GatedMLP(w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"],
                            cfg.hidden_act, mlp_biases if mlp_biases[0] is not None else None)


class LlamaForCausalLM:
    """Weights as plain tensors; forward(input_ids [T], positions [T], ...) -> hidden [T, hidden].

    dtype: the weights' and activations' dtype. Weights already stored in it are views of the
    checkpoint's files (mapped, not copied); others are converted copies. RMSNorm statistics and
    softmax run in fp32, the final norm and the logits entirely in fp32 (see fp32_logits).
    """

    architecture = "llama"

    def __init__(self, reader, dtype: torch.dtype = torch.float32, max_positions: int | None = None):
        c = reader.config
        self.config = c
        self.hidden_size = c["hidden_size"]
        self.num_heads = c["num_attention_heads"]
        self.num_kv_heads = c.get("num_key_value_heads") or self.num_heads
        self.head_dim = c.get("head_dim") or self.hidden_size // self.num_heads
        self.num_layers = c["num_hidden_layers"]
        self.vocab_size = c["vocab_size"]
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.hidden_act = c.get("hidden_act", "silu")
        self.max_position_embeddings = c.get("max_position_embeddings", 2048)
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        self.scale = self.head_dim ** -0.5
        self.dtype = dtype
        params = rope_parameters(c)
        self.rotary = Rotary(self.head_dim, params, self.max_position_embeddings,
                             max_positions or self.max_position_embeddings, interleaved=False, dtype=dtype)
        self._load(reader, dtype)

    def _load(self, reader, dtype):
        self.embed, self.norm, self.lm_head, self.layers = load_decoder(
            reader, dtype, self.num_layers, lambda w: LlamaLayer(w, self))

    # ---------------------------------------------------------------- cache layout
    def kv_layout(self) -> list[dict[str, CacheSpec]]:
        return self.layout_from_config(self.config)

    @staticmethod
    def layout_from_config(c: dict) -> list[dict[str, CacheSpec]]:
        """Per layer: post-RoPE k and v, each [kv_heads, head_dim] per token."""
        heads = c["num_attention_heads"]
        row = CacheSpec((c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads))
        return [{"k": row, "v": row} for _ in range(c["num_hidden_layers"])]

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, meta: AttentionMetadata,
                attn) -> torch.Tensor:
        x = self.embed[input_ids].to(self.dtype)
        angles = self.rotary.angles(positions)
        for layer, stores in zip(self.layers, cache.layers):
            x = x + self._attention(layer, rms_norm(x, layer.input_norm, self.eps), angles, stores, meta, attn)
            x = x + layer.mlp(rms_norm(x, layer.post_norm, self.eps))
        return final_norm(x, self.norm, self.eps)

    def _attention(self, layer: LlamaLayer, x, angles, stores, meta, attn):
        t = x.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = (linear(x, w, b) for w, b in layer.qkv)
        q = self.rotary(q.view(t, hq, d), angles)
        k = self.rotary(k.view(t, hk, d), angles)
        attn.write(stores["k"], k, meta)
        attn.write(stores["v"], v.view(t, hk, d), meta)
        out = attn.gqa(q, stores["k"], stores["v"], meta, self.scale)
        return linear(out.reshape(t, hq * d), layer.o, layer.o_bias)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (already normed, fp32) -> fp32 logits [N, vocab]."""
        return fp32_logits(hidden, self.lm_head)
