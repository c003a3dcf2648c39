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
from kvconvert.number_formats import FP8_DTYPE

from ._launch import (
    LOG2E, DecodeOptions, check_decode, check_softmax_scale, decode_reference,
    merge_splits, partial_strides, resolve_dot, split_outputs,
)
from ._triton_compat import HAS_TRITON, check_kernel_device, next_power_of_2, require_triton, tl, triton
from .cache_layout import GQACacheLayer
from .dequant import MODE_IDS, aux_broadcastable, dot_constexprs

if HAS_TRITON:
    from .dequant import (
        NVFP4_TINY, load_fp8_byte_planes, load_kv_tile, load_nvfp4_halves, load_nvfp4_nibble_planes, probs_operand,
    )
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
        WORD_PLANES: tl.constexpr, PLANES: tl.constexpr,
    ):
        """MODE_NVFP4 K and V are computed on even/odd feature halves (``load_nvfp4_halves``):
        q.k = q[0::2].k_even + q[1::2].k_odd; out[0::2] and out[1::2] accumulate separately.
        WORD_PLANES: k_ptr / v_ptr are the fp8 or packed NVFP4 rows as int16 words (strides in words), computed on
        their byte planes (fp8: even/odd features) or nibble planes (NVFP4: features q mod 4, values times
        2^-14), as the MLA kernel's latent. PLANES: 1 (whole rows), 2 (even/odd) or 4 (features q mod 4)."""
        b = tl.program_id(0)
        kv_head = tl.program_id(1) // groups_per_kv
        in_group = (tl.program_id(1) % groups_per_kv) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(2)
        h_mask = in_group < GROUP
        offs_h = kv_head * GROUP + in_group  # query heads served by this KV head
        HALF: tl.constexpr = BLOCK_D // 2
        QUARTER: tl.constexpr = BLOCK_D // 4

        start, end = split_token_range(seq_lens_ptr, b, split, num_splits, BLOCK_N)

        q_rows = q_ptr + b * stride_q_b + offs_h[:, None] * stride_q_h
        k_scale = tl.load(k_scale_ptr + kv_head * stride_k_scale)
        v_scale = tl.load(v_scale_ptr + kv_head * stride_v_scale)
        kvh = kv_head.to(tl.int64)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        if PLANES == 4:  # (q_even, q_odd, acc_even, acc_odd: planes 0 and 1; q_2, q_3, acc_2, acc_3: 2 and 3)
            q_even, q_scale = load_query_rows(q_rows, h_mask, D // 4, 4, DOT_DTYPE, QUARTER)
            q_odd, q_scale = load_query_rows(q_rows + 1, h_mask, D // 4, 4, DOT_DTYPE, QUARTER)
            q_2, q_scale = load_query_rows(q_rows + 2, h_mask, D // 4, 4, DOT_DTYPE, QUARTER)
            q_3, q_scale = load_query_rows(q_rows + 3, h_mask, D // 4, 4, DOT_DTYPE, QUARTER)
            acc_even = tl.zeros([BLOCK_H, QUARTER], tl.float32)
            acc_odd = tl.zeros([BLOCK_H, QUARTER], tl.float32)
            acc_2 = tl.zeros([BLOCK_H, QUARTER], tl.float32)
            acc_3 = tl.zeros([BLOCK_H, QUARTER], tl.float32)
        elif PLANES == 2:
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
            if PLANES == 4:
                k_even, k_odd, k_2, k_3 = load_nvfp4_nibble_planes(k_ptr, k_off, n_mask, D, k_aux_ptr, k_aux_off,
                                                                   AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_D)
                v_even, v_odd, v_2, v_3 = load_nvfp4_nibble_planes(v_ptr, v_off, n_mask, D, v_aux_ptr, v_aux_off,
                                                                   AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_D)
                qk = dot_scores(q_even, q_scale, k_even, DOT_DTYPE, DOT_PRECISION)
                qk += dot_scores(q_odd, q_scale, k_odd, DOT_DTYPE, DOT_PRECISION)
                qk += dot_scores(q_2, q_scale, k_2, DOT_DTYPE, DOT_PRECISION)
                qk += dot_scores(q_3, q_scale, k_3, DOT_DTYPE, DOT_PRECISION)
                qk = qk * NVFP4_TINY  # the planes' values carry 2^-14
            elif WORD_PLANES:
                k_even, k_odd = load_fp8_byte_planes(k_ptr, k_off, n_mask, D, DOT_DTYPE, BLOCK_N, BLOCK_D)
                v_even, v_odd = load_fp8_byte_planes(v_ptr, v_off, n_mask, D, DOT_DTYPE, BLOCK_N, BLOCK_D)
                qk = dot_scores(q_even, q_scale, k_even, DOT_DTYPE, DOT_PRECISION)
                qk += dot_scores(q_odd, q_scale, k_odd, DOT_DTYPE, DOT_PRECISION)
            elif MODE == 3:
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
            if PLANES >= 2:
                acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even, input_precision=DOT_PRECISION)
                acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision=DOT_PRECISION)
            if PLANES == 4:
                acc_2 = acc_2 * alpha[:, None] + tl.dot(p, v_2, input_precision=DOT_PRECISION)
                acc_3 = acc_3 * alpha[:, None] + tl.dot(p, v_3, input_precision=DOT_PRECISION)
            if PLANES == 1:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)

        l_safe = finish_softmax(m_i, l_i, part_lse_ptr + b * stride_pl_b + offs_h * stride_pl_h + split, h_mask)
        out_rows = part_out_ptr + b * stride_po_b + offs_h[:, None] * stride_po_h + split * stride_po_s
        if PLANES == 4:
            n4, tiny_scale = D // 4, v_scale * NVFP4_TINY
            store_partial_output(out_rows, acc_even, l_safe, tiny_scale, h_mask, n4, 4, MODE, DOT_DTYPE, QUARTER)
            store_partial_output(out_rows + 1, acc_odd, l_safe, tiny_scale, h_mask, n4, 4, MODE, DOT_DTYPE, QUARTER)
            store_partial_output(out_rows + 2, acc_2, l_safe, tiny_scale, h_mask, n4, 4, MODE, DOT_DTYPE, QUARTER)
            store_partial_output(out_rows + 3, acc_3, l_safe, tiny_scale, h_mask, n4, 4, MODE, DOT_DTYPE, QUARTER)
        elif PLANES == 2:
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


def _kv_words(cache: GQACacheLayer, opts: DecodeOptions, block_d: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """((k, v) as the kernel reads them, its PLANES constexpr). word_planes: fp8 or packed NVFP4 rows as int16
    words, on 2 byte planes or 4 nibble planes (as the MLA latent, kvconvert.kernels.mla_decode); otherwise the
    cache's own tensors and 2 planes for NVFP4's even/odd halves, 1 for whole rows."""
    if not opts.word_planes:
        return (cache.k, cache.v), 2 if cache.mode == "nvfp4" else 1
    planes = {"fp8": 2, "nvfp4": 4}.get(cache.mode)
    if planes is None or (cache.mode == "fp8" and cache.k.dtype != FP8_DTYPE):
        raise KVConvertError(f"word_planes reads fp8 (e4m3) or nvfp4 K/V as 16-bit words, not a {cache.mode!r} cache "
                             f"of {cache.k.dtype}: drop the option")
    if opts.dot == "fp8":
        raise KVConvertError("word_planes computes on feature planes: it takes bf16/fp16/fp32 dots (fp8 dots quantize "
                             "whole query rows)")
    if cache.k.shape[-1] % 2 or block_d // planes < 16:
        raise KVConvertError(f"word_planes needs an even row width and head_dim > {8 * planes} (its planes are dot "
                             f"operands of at least 16 features), got {cache.head_dim}")
    return (cache.k.view(torch.int16), cache.v.view(torch.int16)), planes


def paged_gqa_decode_triton(q: torch.Tensor, cache: GQACacheLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            softmax_scale: float, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton split-KV GQA decode + LSE merge -> (out ``[B, Hq, D]`` q dtype, lse ``[B, Hq]`` fp32).
    options: :class:`~kvconvert.kernels._launch.DecodeOptions`."""
    require_triton()
    _check_decode_inputs(q, cache, block_tables, seq_lens, softmax_scale)
    opts = DecodeOptions(**options)
    if opts.latent_loads != 1:
        raise KVConvertError("latent_loads is an MLA option: a GQA step reads K and V as separate tiles")
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
    (k, v), planes = _kv_words(cache, opts, block_d)
    # NVFP4 block-scale groups: 8 bytes of even/odd halves, or 4 words of nibble planes
    broadcast = aux_broadcastable(16 // planes, block_d // planes) if cache.mode == "nvfp4" else aux_broadcastable(16, block_d)
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
        BLOCK_D=block_d, WORD_PLANES=opts.word_planes, PLANES=planes, **opts.launch,
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
