"""Function-level kernel API for the runtime: Triton kernels (``backend='triton'``) or their PyTorch
references (``backend='torch'``), same shapes and results within the tolerances the tests state.

Cache layouts and paging conventions: :mod:`kvconvert.kernels.cache_layout`. Typical decode step::

    cache = MLACacheLayer.allocate("fp8", num_blocks, 16, kv_lora_rank=512, rope_dim=64, kv_scale=s)
    cache.append(latent, k_rope, slot_mapping)                        # quantize + kv_append
    out, lse = paged_mla_decode(q_nope_absorbed, q_rope, cache, block_tables, seq_lens, scale)
"""

from __future__ import annotations

import torch

from ._launch import BACKENDS, check_backend
from .append import kv_append
from .cache_layout import GQACacheLayer, MLACacheLayer
from .gqa_decode import paged_gqa_decode_reference, paged_gqa_decode_triton
from .merge import merge_lse_reference, merge_lse_triton
from .mla_decode import paged_mla_decode_reference, paged_mla_decode_triton

def paged_mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: MLACacheLayer,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    *,
    backend: str = "triton",
    **kernel_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: q_nope ``[B, H, R]``, q_rope ``[B, H, P]`` -> (out ``[B, H, R]``, lse ``[B, H]``).

    ``kernel_options`` (triton only): num_splits, dot ('fp32'|'bf16'|'fp16'), block_h, block_n,
    num_warps, num_stages.
    """
    check_backend(backend)
    if backend == "torch":
        return paged_mla_decode_reference(q_nope, q_rope, cache, block_tables, seq_lens, softmax_scale)
    return paged_mla_decode_triton(q_nope, q_rope, cache, block_tables, seq_lens, softmax_scale, **kernel_options)


def paged_gqa_decode(
    q: torch.Tensor,
    cache: GQACacheLayer,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    *,
    backend: str = "triton",
    **kernel_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA decode: q ``[B, Hq, D]`` -> (out ``[B, Hq, D]``, lse ``[B, Hq]``); options as for MLA."""
    check_backend(backend)
    if backend == "torch":
        return paged_gqa_decode_reference(q, cache, block_tables, seq_lens, softmax_scale)
    return paged_gqa_decode_triton(q, cache, block_tables, seq_lens, softmax_scale, **kernel_options)


def merge_lse(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    backend: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge parts ``[..., S, D]`` with LSEs ``[..., S]`` -> (``[..., D]``, ``[...]``); see :mod:`.merge`."""
    check_backend(backend)
    if backend == "torch":
        return merge_lse_reference(partial_out, partial_lse, out_dtype)
    return merge_lse_triton(partial_out, partial_lse, out_dtype)


__all__ = [
    "BACKENDS",
    "MLACacheLayer",
    "GQACacheLayer",
    "kv_append",
    "paged_mla_decode",
    "paged_gqa_decode",
    "merge_lse",
]
