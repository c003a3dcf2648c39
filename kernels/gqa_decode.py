"""Paged GQA decode with fused FP8 / NVFP4 K/V dequantization.

Math: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``::

    out[b, h] = sum_t softmax_t(softmax_scale * q[b, h] . k[t, kvh]) * v[t, kvh]

Shapes: ``q`` ``[batch, q_heads, head_dim]``; cache :class:`~kvconvert.kernels.cache_layout.GQACacheLayer`
(``k``/``v`` ``[num_blocks, block_size, kv_heads, head_dim]`` or packed NVFP4, with per-tensor or
per-head scales); ``block_tables`` int32 ``[batch, max_blocks]``; ``seq_lens`` int32 ``[batch]``.
Output ``[batch, q_heads, head_dim]`` in q's dtype and the natural-log LSE fp32 ``[batch, q_heads]``.

Kernel: one program per (sequence, KV head, group of up to BLOCK_H query heads, KV range), so each
K/V tile is read once for all query heads that share it (padded to BLOCK_H >= 16 rows for tl.dot);
stage 2 merges the ranges by LSE.
"""

from __future__ import annotations

import torch

from kvconvert.errors import KVConvertError

from ._launch import (
    LOG2E, DecodeOptions, check_decode, check_softmax_scale, decode_reference,
    merge_splits, partial_strides, resolve_dot, split_outputs,
)
from ._triton_compat import HAS_TRITON, check_kernel_device, next_power_of_2, require_triton, tl, triton
from .cache_layout import GQACacheLayer
from .dequant import MODE_IDS, aux_broadcastable, dot_constexprs

if HAS_TRITON:
    from .dequant import load_kv_tile, load_nvfp4_halves, probs_operand
    from .split_softmax import (
        dot_scores, finish_softmax, load_query_rows, online_softmax_step, split_token_range, store_partial_output,
        tile_slots,
    )

    # num_splits is not specialized (Triton would compile apart for values divisible by 16, e.g. 32 splits
    # at 8K and 33 at 32K): one compile per launch config serves every context
    @triton.jit(do_not_specialize=["num_splits"])
    def _gqa_decode_split_kernel(
        q_ptr, k_ptr, v_ptr, k_aux_ptr, v_aux_ptr, k_scale_ptr, v_scale_ptr,
        block_tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
        qk_scale_log2,
        GROUP, D, block_size, num_splits, groups_per_kv,
        stride_q_b, stride_q_h,
        stride_k_blk, stride_k_tok, stride_k_head, stride_v_blk, stride_v_tok, stride_v_head,
        stride_ka_blk, stride_ka_tok, stride_ka_head, stride_va_blk, stride_va_tok, stride_va_head,
        stride_k_scale, stride_v_scale,
        stride_bt_b,
        stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h,
        MODE: tl.constexpr, AUX_BROADCAST: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """MODE_NVFP4 K and V are computed on even/odd feature halves (``load_nvfp4_halves``):
        q.k = q[0::2].k_even + q[1::2].k_odd; out[0::2] and out[1::2] accumulate separately."""
        b = tl.program_id(0)
        kv_head = tl.program_id(1) // groups_per_kv
        in_group = (tl.program_id(1) % groups_per_kv) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(2)
        h_mask = in_group < GROUP
        offs_h = kv_head * GROUP + in_group  # query heads served by this KV head
        HALF: tl.constexpr = BLOCK_D // 2

        start, end = split_token_range(seq_lens_ptr, b, split, num_splits, BLOCK_N)

        q_rows = q_ptr + b * stride_q_b + offs_h[:, None] * stride_q_h
        k_scale = tl.load(k_scale_ptr + kv_head * stride_k_scale)
        v_scale = tl.load(v_scale_ptr + kv_head * stride_v_scale)
        kvh = kv_head.to(tl.int64)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        if MODE == 3:
            q_even, q_scale = load_query_rows(q_rows, h_mask, D // 2, 2, DOT_DTYPE, HALF)
            q_odd, q_scale = load_query_rows(q_rows + 1, h_mask, D // 2, 2, DOT_DTYPE, HALF)
            acc_even = tl.zeros([BLOCK_H, HALF], tl.float32)
            acc_odd = tl.zeros([BLOCK_H, HALF], tl.float32)
        else:
            q, q_scale = load_query_rows(q_rows, h_mask, D, 1, DOT_DTYPE, BLOCK_D)
            acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n_mask, phys, slot = tile_slots(block_tables_ptr + b * stride_bt_b, n0, end, block_size, BLOCK_N)
            k_off = phys * stride_k_blk + slot * stride_k_tok + kvh * stride_k_head
            v_off = phys * stride_v_blk + slot * stride_v_tok + kvh * stride_v_head
            k_aux_off = phys * stride_ka_blk + slot * stride_ka_tok + kvh * stride_ka_head
            v_aux_off = phys * stride_va_blk + slot * stride_va_tok + kvh * stride_va_head
            if MODE == 3:
                k_even, k_odd = load_nvfp4_halves(
                    k_ptr, k_off, n_mask, D, k_aux_ptr, k_aux_off, AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_D, False
                )
                v_even, v_odd = load_nvfp4_halves(
                    v_ptr, v_off, n_mask, D, v_aux_ptr, v_aux_off, AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_D, False
                )
                qk = dot_scores(q_even, q_scale, k_even, DOT_DTYPE, DOT_PRECISION)
                qk += dot_scores(q_odd, q_scale, k_odd, DOT_DTYPE, DOT_PRECISION)
            else:
                k = load_kv_tile(
                    k_ptr, k_off, n_mask, D, k_aux_ptr, k_aux_off, MODE, 16, AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_D, False
                )
                v = load_kv_tile(
                    v_ptr, v_off, n_mask, D, v_aux_ptr, v_aux_off, MODE, 16, AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_D, False
                )
                qk = dot_scores(q, q_scale, k, DOT_DTYPE, DOT_PRECISION)
            if MODE == 1 or MODE == 3:  # raw fp8 / e2m1 * block-scale keys: the head's scale, on the scores
                qk = qk * k_scale
            p, alpha, m_i, l_i = online_softmax_step(qk, n_mask, m_i, l_i, qk_scale_log2)
            p = probs_operand(p, DOT_DTYPE)
            if MODE == 3:
                acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even, input_precision=DOT_PRECISION)
                acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision=DOT_PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)

        l_safe = finish_softmax(m_i, l_i, part_lse_ptr + b * stride_pl_b + offs_h * stride_pl_h + split, h_mask)
        out_rows = part_out_ptr + b * stride_po_b + offs_h[:, None] * stride_po_h + split * stride_po_s
        if MODE == 3:
            store_partial_output(out_rows, acc_even, l_safe, v_scale, h_mask, D // 2, 2, MODE, DOT_DTYPE, HALF)
            store_partial_output(out_rows + 1, acc_odd, l_safe, v_scale, h_mask, D // 2, 2, MODE, DOT_DTYPE, HALF)
        else:
            store_partial_output(out_rows, acc, l_safe, v_scale, h_mask, D, 1, MODE, DOT_DTYPE, BLOCK_D)


def _check_decode_inputs(q, cache: GQACacheLayer, block_tables, seq_lens, softmax_scale) -> None:
    check_decode(cache, GQACacheLayer, (q,), block_tables, seq_lens, softmax_scale)
    if q.shape[2] != cache.head_dim:
        raise KVConvertError(f"q {tuple(q.shape)} must be [batch, q_heads, head_dim={cache.head_dim}]")
    if q.shape[1] % cache.kv_heads:
        raise KVConvertError(f"q_heads {q.shape[1]} is not a multiple of kv_heads {cache.kv_heads}")


def _scale_stride(s: torch.Tensor) -> int:
    return 0 if s.numel() == 1 else s.stride(0)


def paged_gqa_decode_triton(q: torch.Tensor, cache: GQACacheLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            softmax_scale: float, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton split-KV GQA decode + LSE merge -> (out ``[B, Hq, D]`` q dtype, lse ``[B, Hq]`` fp32).
    options: :class:`~kvconvert.kernels._launch.DecodeOptions`."""
    require_triton()
    _check_decode_inputs(q, cache, block_tables, seq_lens, softmax_scale)
    opts = DecodeOptions(**options)
    if opts.latent_loads != 1:
        raise KVConvertError("latent_loads is an MLA option: a GQA step reads K and V as separate tiles")
    if opts.word_planes:
        raise KVConvertError("word_planes is an MLA option (its latent tile feeds both dots)")
    check_kernel_device(q, cache.k, cache.v, block_tables, seq_lens)
    q_heads, d = q.shape[1:]
    group = q_heads // cache.kv_heads
    block_d = max(16, next_power_of_2(d))
    ones = torch.ones(1, dtype=torch.float32, device=q.device)
    k_scale = cache.k_scale if cache.k_scale is not None else ones
    v_scale = cache.v_scale if cache.v_scale is not None else ones
    k_aux = cache.k_block_scales if cache.k_block_scales is not None else cache.k
    v_aux = cache.v_block_scales if cache.v_block_scales is not None else cache.v

    groups_per_kv = triton.cdiv(group, opts.block_h)
    head_groups = cache.kv_heads * groups_per_kv
    part_out, part_lse = split_outputs(q, d, head_groups, block_tables, cache.block_size, opts)
    splits = part_out.shape[2]
    k, v = cache.k, cache.v
    # NVFP4: even/odd halves of BLOCK_D // 2 features share block-scale groups of 8 bytes
    broadcast = aux_broadcastable(8, block_d // 2) if cache.mode == "nvfp4" else aux_broadcastable(16, block_d)
    _gqa_decode_split_kernel[(q.shape[0], head_groups, splits)](
        q, k, v, k_aux, v_aux, k_scale, v_scale, block_tables, seq_lens, part_out, part_lse,
        check_softmax_scale(softmax_scale) * LOG2E,
        group, d, cache.block_size, splits, groups_per_kv,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_aux.stride(0), k_aux.stride(1), k_aux.stride(2), v_aux.stride(0), v_aux.stride(1), v_aux.stride(2),
        _scale_stride(k_scale), _scale_stride(v_scale),
        block_tables.stride(0),
        *partial_strides(part_out, part_lse),
        MODE=MODE_IDS[cache.mode], AUX_BROADCAST=broadcast, **dot_constexprs(resolve_dot(opts.dot, q, cache)),
        BLOCK_D=block_d, **opts.launch,
    )
    return merge_splits(part_out, part_lse, q.dtype)


def paged_gqa_decode_reference(
    q: torch.Tensor,
    cache: GQACacheLayer,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference (float64 on the dequantized cache): same contract as the Triton launcher."""
    _check_decode_inputs(q, cache, block_tables, seq_lens, softmax_scale)
    group = q.shape[1] // cache.kv_heads

    def attend(b, k, v):  # k, v [n, kv_heads, D] -> scores [Hq, n], values [Hq, n, D]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        return softmax_scale * torch.einsum("hd,nhd->hn", q[b].double(), k), v.transpose(0, 1)

    return decode_reference(q, cache, block_tables, seq_lens, cache.head_dim, attend)
