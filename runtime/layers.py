"""What both runtime models share around the per-architecture maths (kvconvert.models): loading
mapped weights, the RoPE table, the decoder loop over the paged cache, and fp32 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvconvert.models.common import DecoderLayer, rms_norm, short_names
from kvconvert.runtime.memory import KEEP_FP32_HEAD


class Decoder:
    """A decoder of kvconvert.models' layers (DecoderLayer of attention_cls) over the paged KV cache.
    Subclasses give shape_cls (kvconvert.models' shape, from_config), attention_cls and
    attention(layer.attn, x, angles, layer_cache, meta, attn) (layer_cache: PagedKVCache.layers[i]).

    cos/sin for every position up to max_positions are precomputed as transformers computes them:
    fp32 position * inv_freq, cos/sin, times the attention factor.

    Weights are mapped in `dtype` (views of the files when it is the stored dtype) and, for another
    device, copied there one tensor at a time, each tensor's mapped pages dropped after its copy:
    the model is never resident in host memory (on the CPU they stay views of the files)."""

    shape_cls: type
    attention_cls: type

    def __init__(self, reader, dtype: torch.dtype = torch.float32, max_positions: int | None = None,
                 device: torch.device | str = "cpu"):
        shape = self.shape_cls.from_config(reader.config)
        self.config, self.shape, self.dtype = reader.config, shape, dtype
        self.vocab_size, self.eps, self.device = shape.vocab, shape.rms_eps, torch.device(device)
        positions = torch.arange(max_positions or shape.max_position_embeddings)
        # [positions, rope dim / 2], computed on the CPU (the same table on every device)
        self.cos, self.sin = (t.to(self.device) for t in shape.rope.cos_sin(positions, dtype))
        self.embed, self.norm = (self._weight(reader, n) for n in ("model.embed_tokens.weight", "model.norm.weight"))
        self.lm_head = self._weight(reader, "lm_head.weight") if "lm_head.weight" in reader else self.embed  # tied
        self.layers = [DecoderLayer.of(short_names({k: self._weight(reader, k) for k in reader.keys()
                                                    if k.startswith(f"model.layers.{i}.")}),
                                       self.attention_cls, shape.hidden_act) for i in range(shape.layers)]

    def _weight(self, reader, name: str) -> torch.Tensor:
        """One tensor in self.dtype on self.device: on the CPU a view of the mapped file; elsewhere
        a copy, after which the mapped pages are dropped."""
        tensor = reader.mapped(name, self.dtype).to(self.device)
        if self.device.type != "cpu":
            reader.drop_pages(name)
        return tensor

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, meta, attn) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden] (fp32)."""
        x = self.embed[input_ids].to(self.dtype)
        angles = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [T, 1, dim/2], shared by layers
        for layer, layer_cache in zip(self.layers, cache.layers):
            normed = rms_norm(x, layer.input_layernorm, self.eps)
            x = x + self.attention(layer.attn, normed, angles, layer_cache, meta, attn)
            x = x + layer.mlp(rms_norm(x, layer.post_attention_layernorm, self.eps))
        return rms_norm(x.float(), self.norm.float(), self.eps)  # the last norm in fp32: it feeds the logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (already normed, fp32) -> fp32 logits [N, vocab]."""
        if not hasattr(self, "_fp32_chunks"):  # bf16/fp16 lm_head small enough: its fp32 chunks, upcast once
            self._fp32_chunks = upcast_chunks(self.lm_head)
        return fp32_logits(hidden, self.lm_head, self._fp32_chunks)


LOGIT_CHUNK = 8192  # vocabulary rows upcast at a time: bounds the fp32 copy of lm_head (8192 x hidden)


def upcast_chunks(lm_head: torch.Tensor) -> list[torch.Tensor] | None:
    """The fp32 copies of a 16-bit lm_head's LOGIT_CHUNK-row chunks, when they take at most KEEP_FP32_HEAD
    bytes (SmolLM2's 49152 x 576: 113 MB), else None. Upcasting them at every decode step cost a bf16
    SmolLM2 about a fifth of its step on a CPU; kept, the products are the same (same chunks, same values)."""
    if lm_head.dtype == torch.float32 or lm_head.numel() * 4 > KEEP_FP32_HEAD:
        return None
    return [lm_head[lo:lo + LOGIT_CHUNK].float() for lo in range(0, lm_head.shape[0], LOGIT_CHUNK)]


def fp32_logits(hidden: torch.Tensor, lm_head: torch.Tensor, chunks: list[torch.Tensor] | None = None) -> torch.Tensor:
    """hidden [N, hidden] -> fp32 logits [N, vocab] with fp32 products and output.

    A bf16 matmul accumulates in fp32 but rounds its output to bf16 (8 bits: a logit of 20 lands on
    a 0.125 grid), which perplexity and KL would see; so bf16/fp16 weights are upcast a chunk of
    rows at a time (or taken from `chunks`, upcast_chunks' copies) and multiplied in fp32. fp32 weights
    go straight through.
    """
    hidden = hidden.float()
    if lm_head.dtype == torch.float32:
        return F.linear(hidden, lm_head)
    out = hidden.new_empty(hidden.shape[0], lm_head.shape[0])
    for i, lo in enumerate(range(0, lm_head.shape[0], LOGIT_CHUNK)):
        hi = min(lo + LOGIT_CHUNK, lm_head.shape[0])
        out[:, lo:hi] = F.linear(hidden, chunks[i] if chunks is not None else lm_head[lo:hi].float())
    return out
