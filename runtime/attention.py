"""Paged attention backends, chosen by name: "torch" (reference) and "triton" (kvconvert.kernels).

A step's tokens are flat: [T, ...]. The model runner orders them decode-first: the first
``num_decode`` sequences contribute exactly one token each (tokens [0, num_decode)), then each
prefill sequence contributes a chunk of its prompt. Attention always reads K/V back from the
paged cache after this step's K/V were written, so what the model attends to is exactly what
the cache stores (quantized caches included), in prefill and in decode alike.

Context length ``ctx`` of a sequence = tokens in its cache after this step's write; its queries
sit at positions ctx - q_len .. ctx - 1 and attend causally to positions 0 .. their own.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import kv_pair
from kvconvert.runtime import kv_cache
from kvconvert.runtime.kv_cache import Workspace


def length_mask(context_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] bool: key j of sequence b is valid if j < context_lens[b]."""
    return torch.arange(width, device=context_lens.device)[None, :] < context_lens[:, None]


@dataclass
class PrefillChunk:
    """One sequence's multi-token chunk: tokens [query_start, query_start + query_len) of the step."""

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [n_blocks] long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    block_size: int
    num_decode: int  # decode sequences = decode tokens, first in the step
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] long (padded with block 0)
    decode_context_lens: torch.Tensor  # [num_decode] long
    prefills: list[PrefillChunk]
    # longest decode context, and [num_decode, 1, 1, decode_max_len] bool key-valid mask (None when
    # every decode sequence has that length: nothing to mask); the runner derives both from its
    # host-side lengths, so no step waits on a device read
    decode_max_len: int = 0
    decode_mask: torch.Tensor | None = None


class TorchAttention:
    """Vectorized PyTorch reference: gather the sequence's blocks, dequantize, attend.

    Cache reads land in reusable workspace buffers (no fresh allocation per layer). K/V are read
    heads-first, [B, KVH, S, D] (the gather's dtype-converting copy also transposes), so decode is
    two batched matmuls and prefill is SDPA; MLA decode reads its rows in place.
    """

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu"):
        self.workspace = Workspace(device)

    # ---------------------------------------------------------------- cache access
    # `layer`: one layer's cache, a kvconvert.kernels GQACacheLayer (k, v) or MLACacheLayer (row "kv")
    def write(self, layer, first: torch.Tensor, second: torch.Tensor, meta: AttentionMetadata) -> None:
        """New tokens (GQA: k, v [T, kv_heads, head_dim]; MLA: latent [T, R], k_rope [T, P]) -> the
        layer's cache at meta.slot_mapping."""
        kv_cache.write(layer, first, second, meta.slot_mapping, self.workspace)

    def read_rows(self, layer, chunk: PrefillChunk, dtype: torch.dtype) -> torch.Tensor:
        """The chunk's sequence context of an MLA layer, dequantized: [context_len, R + P] (a
        workspace buffer: use it before the next read)."""
        return self._rows(layer, chunk.block_table[None], dtype, "rows")[0, : chunk.context_len]

    def _rows(self, layer, block_tables: torch.Tensor, dtype: torch.dtype, name: str):
        """The blocks' MLA rows, dequantized: [B, n * block_size, R + P] (a workspace buffer)."""
        b, width = block_tables.shape[0], block_tables.shape[1] * layer.block_size
        out = self.workspace.get(name, (b, width, *layer.row_shape), dtype)
        return kv_cache.gather(layer, "kv", block_tables, out, self.workspace)

    def _heads_first(self, layer, side: str, block_tables: torch.Tensor, dtype: torch.dtype):
        """K or V (side "k" / "v") of the blocks as [B, KVH, n * block_size, D] (contiguous)."""
        b, width = block_tables.shape[0], block_tables.shape[1] * layer.block_size
        kvh, d = layer.row_shape
        buf = self.workspace.get(side, (b, kvh, width, d), dtype)
        kv_cache.gather(layer, side, block_tables, buf.transpose(1, 2), self.workspace)
        return buf

    # ---------------------------------------------------------------- MHA / GQA
    def gqa(self, q: torch.Tensor, layer, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D] -> out [T, H, D]; K/V [.., kv_heads, D] with H % kv_heads == 0
        (query head h reads KV head h // (H / kv_heads), as transformers' repeat_kv)."""
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            out[:nd] = self.gqa_decode(q[:nd], layer, meta, scale)
        for c in meta.prefills:
            table = c.block_table[None]
            k = self._heads_first(layer, "k", table, q.dtype)[:, :, : c.context_len]  # [1, KVH, S, D]
            v = self._heads_first(layer, "v", table, q.dtype)[:, :, : c.context_len]
            span = slice(c.query_start, c.query_start + c.query_len)
            o = causal_sdpa(q[span].transpose(0, 1)[None], k, v, c.query_len, c.context_len, scale)  # [1, H, L, D]
            out[span] = o[0].transpose(0, 1)
        return out

    def gqa_decode(self, q, layer, meta, scale):
        """q [B, H, D], one token per sequence -> [B, H, D].

        K/V are read heads-first, [B, KVH, S, D]; each (sequence, KV head) pair is one batch entry
        of two matmuls, its G = H / KVH query heads the rows: scores [B*KVH, G, S]."""
        b, h, d = q.shape
        s = meta.decode_max_len
        k = self._heads_first(layer, "k", meta.decode_block_tables, q.dtype)[:, :, :s]  # [B, KVH, S, D]
        v = self._heads_first(layer, "v", meta.decode_block_tables, q.dtype)[:, :, :s]
        kvh = k.shape[1]
        qg = q.reshape(b * kvh, h // kvh, d)
        scores = torch.bmm(qg, k.flatten(0, 1).transpose(1, 2)) * scale  # [B*KVH, G, S]
        if meta.decode_mask is not None:
            scores = scores.view(b, kvh, h // kvh, s).masked_fill_(~meta.decode_mask, float("-inf")).flatten(0, 1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, v.flatten(0, 1)).view(b, h, d)

    # ---------------------------------------------------------------- MLA
    def mla_decode(self, q: torch.Tensor, layer, meta: AttentionMetadata, scale: float,
                   latent_dim: int) -> torch.Tensor:
        """Absorbed MLA decode, MQA over cached rows [latent | k_rope].

        q [B, H, latent_dim + rope] (q_nope @ W_UK, then q_rope) -> out [B, H, latent_dim]
        = softmax(scale * q . row) @ latent (the caller applies W_UV). Two batched matmuls read the
        rows in place (the latent is a strided view): no per-head K/V is ever formed.
        """
        rows = self._rows(layer, meta.decode_block_tables, q.dtype, "rows")[:, : meta.decode_max_len]  # [B, S, R]
        scores = torch.bmm(q, rows.transpose(1, 2)) * scale  # [B, H, S]
        if meta.decode_mask is not None:
            scores.masked_fill_(~meta.decode_mask[:, 0], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, rows[..., :latent_dim])


def causal_sdpa(q, k, v, query_len, context_len, scale):
    """q [..., H, L, D], k/v [..., KVH, S, D*] with causal offset (the L queries are the last of the
    S positions); GQA by head groups."""
    gqa = k.shape[-3] != q.shape[-3]
    if query_len == context_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    q_pos = torch.arange(context_len - query_len, context_len, device=q.device)  # each query's position
    mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]  # [L, S] bool: keys up to it
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class TritonAttention(TorchAttention):
    """Cache writes (kv_append) and decode (paged_gqa_decode / paged_mla_decode) through the Triton
    kernels of kvconvert.kernels.attention; multi-token prefill chunks (compute-bound) stay on the
    PyTorch path. The runtime's cache layers are the kernels' (kvconvert.kernels.cache_layout), so
    the kernels read them in place. On a CPU the kernels need TRITON_INTERPRET=1 (slow; for tests)."""

    name = "triton"

    def __init__(self, kv_dtype: str, device: torch.device | str = "cpu"):
        fmt = kv_pair(kv_dtype).k  # a mixed pair is llama.cpp's types, refused below
        if fmt.ggml_type:
            raise KVConvertError(f"the Triton kernels do not read llama.cpp's cache types ({fmt.name}): the runtime "
                                 "emulates them with --backend torch")
        if fmt.integer:
            raise KVConvertError(f"the Triton kernels do not read an {fmt.title} cache ({fmt.name}): the runtime "
                                 "reads it with --backend torch")
        if fmt.kernel_mode is None:  # fp8_e5m2
            raise KVConvertError("the Triton kernels read fp8 e4m3 caches only; use kv_dtype fp8 or --backend torch")
        from kvconvert.kernels import attention as kernels  # imported here: the torch backend never loads Triton
        from kvconvert.kernels._triton_compat import interpreter_enabled, require_triton

        require_triton()
        if torch.device(device).type == "cpu" and not interpreter_enabled():
            raise KVConvertError("attention backend 'triton' on the CPU runs only in Triton's interpreter: set "
                                 "TRITON_INTERPRET=1 (slow; for tests), use --device cuda, or --backend torch")
        if torch.device(device).type == "cuda" and interpreter_enabled():
            warnings.warn("TRITON_INTERPRET=1 with --device cuda: the Triton kernels run in the interpreter, not "
                          "compiled (slow); unset TRITON_INTERPRET for GPU speed", stacklevel=3)
        super().__init__(device)
        self.kernels = kernels

    def write(self, layer, first: torch.Tensor, second: torch.Tensor, meta: AttentionMetadata) -> None:
        for dst, rows in kv_cache.rows_to_write(layer, first, second):  # quantize in PyTorch, scatter bytes
            self.kernels.kv_append(dst, rows.contiguous(), meta.slot_mapping, backend="triton")

    def gqa_decode(self, q, layer, meta, scale):
        out, _ = self.kernels.paged_gqa_decode(
            q.contiguous(), layer, meta.decode_block_tables.int(), meta.decode_context_lens.int(), scale,
            backend="triton")
        return out

    def mla_decode(self, q, layer, meta, scale, latent_dim):
        out, _ = self.kernels.paged_mla_decode(
            q[..., :latent_dim].contiguous(), q[..., latent_dim:].contiguous(), layer,
            meta.decode_block_tables.int(), meta.decode_context_lens.int(), scale, backend="triton")
        return out


def make_attention(name: str, kv_dtype: str = "bf16", device: torch.device | str = "cpu"):
    """The backend `name` (EngineConfig checked it is one of ATTENTION_BACKENDS)."""
    return TritonAttention(kv_dtype, device) if name == "triton" else TorchAttention(device)
