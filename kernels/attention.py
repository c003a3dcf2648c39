"""Function-level kernel API for the runtime: Triton kernels (``backend='triton'``) or their PyTorch
references (``backend='torch'``), same shapes and results within the tolerances the tests state.

Cache layouts and paging conventions: :mod:`kvconvert.kernels.cache_layout`. Typical decode step::

    cache = MLACacheLayer.allocate("fp8", num_blocks, 16, kv_lora_rank=512, rope_dim=64, kv_scale=s)
    cache.append(latent, k_rope, slot_mapping)                        # quantize + kv_append
    out, lse = paged_mla_decode(q_nope_absorbed, q_rope, cache, block_tables, seq_lens, scale)
"""

from __future__ import annotations

from ._launch import BACKENDS, with_backend
from .append import kv_append
from .cache_layout import GQACacheLayer, MLACacheLayer
from .gqa_decode import paged_gqa_decode_reference, paged_gqa_decode_triton
from .merge import merge_lse_reference, merge_lse_triton
from .mla_decode import paged_mla_decode_reference, paged_mla_decode_triton

# Absorbed MLA decode: paged_mla_decode(q_nope [B, H, R], q_rope [B, H, P], cache: MLACacheLayer, block_tables,
# seq_lens, softmax_scale, *, backend="triton", **kernel_options) -> (out [B, H, R], lse [B, H]).
# kernel_options (triton only): kvconvert.kernels._launch.DecodeOptions.
paged_mla_decode = with_backend(paged_mla_decode_triton, paged_mla_decode_reference)
# GQA decode: paged_gqa_decode(q [B, Hq, D], cache: GQACacheLayer, block_tables, seq_lens, softmax_scale, *,
# backend="triton", **kernel_options) -> (out [B, Hq, D], lse [B, Hq]); options as for MLA.
paged_gqa_decode = with_backend(paged_gqa_decode_triton, paged_gqa_decode_reference)


# merge_lse(partial_out [..., S, D], partial_lse [..., S], out_dtype=torch.float32, *, backend="triton")
# -> (out [..., D], lse [...]); see .merge.
merge_lse = with_backend(merge_lse_triton, merge_lse_reference)


__all__ = [
    "BACKENDS",
    "MLACacheLayer",
    "GQACacheLayer",
    "kv_append",
    "paged_mla_decode",
    "paged_gqa_decode",
    "merge_lse",
]
