"""What both runtime models share around the per-architecture maths (kvconvert.models): loading
mapped weights, the RoPE table, the decoder loop over the paged cache, and fp32 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvconvert.models.common import rms_norm


class Decoder:
    """A decoder of `layer_cls` layers (kvconvert.models' typed weights) over the paged KV cache.
    Subclasses give attention(layer.attn, x, angles, stores, meta, attn) and layout_from_config.

    cos/sin for every position up to max_positions are precomputed as transformers computes them:
    fp32 position * inv_freq, cos/sin, times the attention factor."""

    def __init__(self, reader, shape, layer_cls, dtype: torch.dtype, max_positions: int | None):
        self.config, self.shape, self.dtype = reader.config, shape, dtype
        self.vocab_size, self.eps = shape.vocab, shape.rms_eps
        positions = torch.arange(max_positions or shape.max_position_embeddings)
        self.cos, self.sin = shape.rope.cos_sin(positions, dtype)  # [positions, rope dim / 2]
        self.embed, self.norm, self.lm_head, self.layers = load_decoder(
            reader, dtype, shape.layers, lambda w: layer_cls.from_checkpoint(w, shape))

    def kv_layout(self):
        return self.layout_from_config(self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, meta, attn) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden] (fp32)."""
        x = self.embed[input_ids].to(self.dtype)
        angles = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [T, 1, dim/2], shared by layers
        for layer, stores in zip(self.layers, cache.layers):
            x = x + self.attention(layer.attn, rms_norm(x, layer.input_layernorm, self.eps), angles, stores, meta, attn)
            x = x + layer.mlp(rms_norm(x, layer.post_attention_layernorm, self.eps))
        return rms_norm(x.float(), self.norm.float(), self.eps)  # the last norm in fp32: it feeds the logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (already normed, fp32) -> fp32 logits [N, vocab]."""
        return fp32_logits(hidden, self.lm_head)


LOGIT_CHUNK = 8192  # vocabulary rows upcast at a time: bounds the fp32 copy of lm_head (8192 x hidden)


def fp32_logits(hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """hidden [N, hidden] -> fp32 logits [N, vocab] with fp32 products and output.

    A bf16 matmul accumulates in fp32 but rounds its output to bf16 (8 bits: a logit of 20 lands on
    a 0.125 grid), which perplexity and KL would see; so bf16/fp16 weights are upcast a chunk of
    rows at a time and multiplied in fp32. fp32 weights go straight through.
    """
    hidden = hidden.float()
    if lm_head.dtype == torch.float32:
        return F.linear(hidden, lm_head)
    out = hidden.new_empty(hidden.shape[0], lm_head.shape[0])
    for lo in range(0, lm_head.shape[0], LOGIT_CHUNK):
        hi = min(lo + LOGIT_CHUNK, lm_head.shape[0])
        out[:, lo:hi] = F.linear(hidden, lm_head[lo:hi].float())
    return out


def load_decoder(reader, dtype, num_layers: int, make_layer) -> tuple:
    """(embed, final norm, lm_head, [make_layer(weights) per layer]) mapped from the checkpoint in
    `dtype` (views of the files when it is the stored dtype); lm_head falls back to the tied embedding."""
    def get(name):
        return reader.mapped(name, dtype)
    embed = get("model.embed_tokens.weight")
    lm_head = get("lm_head.weight") if "lm_head.weight" in reader else embed
    layers = []
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        layers.append(make_layer({k[len(prefix):]: v for k, v in reader.tensors(prefix, dtype, mapped=True).items()}))
    return embed, get("model.norm.weight"), lm_head, layers
