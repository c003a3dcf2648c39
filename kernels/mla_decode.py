"""Paged MLA decode (weight-absorbed, MQA over the latent) with fused KV dequantization.

Math (one layer, one new token per sequence; DeepSeek-V3 absorbed form, docs/formats.md)::

    score[b, h, t] = softmax_scale * (q_nope_absorbed[b, h] . c[t] + q_rope[b, h] . k_rope[t])
    out[b, h]      = sum_t softmax_t(score[b, h, :]) * c[t]           (latent-space output)

Shapes: ``q_nope`` ``[batch, heads, kv_lora_rank]`` (q_nope @ W_UK already applied), ``q_rope``
``[batch, heads, rope_dim]``, cache: :class:`~kvconvert.kernels.cache_layout.MLACacheLayer`
(``[num_blocks, block_size, ...]``, see its layouts), ``block_tables`` int32 ``[batch, max_blocks]``,
``seq_lens`` int32 ``[batch]`` (>= 0). Output ``[batch, heads, kv_lora_rank]`` in q's dtype and the
natural-log LSE fp32 ``[batch, heads]`` (-inf for an empty sequence, whose output is 0).

Kernel: stage 1 splits each sequence's tokens into ``num_splits`` ranges; one program handles
(sequence, group of BLOCK_H heads, range): every KV tile is read once for BLOCK_H heads (MQA),
dequantized in registers, and used for both dots (QK^T and PV) with fp32 accumulation and an
online softmax in base 2. Stage 2 merges the ranges by LSE (:mod:`.merge`).
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
from .cache_layout import MLACacheLayer
from .dequant import MODE_FP8, MODE_IDS, MODE_NVFP4, MODE_PLAIN, aux_broadcastable, dot_constexprs

if HAS_TRITON:
    from .dequant import NVFP4_TINY, load_fp8_byte_planes, load_kv_tile, load_nvfp4_halves, load_nvfp4_nibble_planes, probs_operand
    from .split_softmax import (
        dot_scores, dot_scores_t, finish_softmax, load_query_rows, online_softmax_step, split_token_range, store_partial_output,
        tile_slots,
    )

    # num_splits is not specialized (Triton would compile apart for values divisible by 16, e.g. 32 splits
    # at 8K and 33 at 32K): one compile per launch config serves every context
    @triton.jit(do_not_specialize=["num_splits"])
    def _mla_decode_split_kernel(
        q_nope_ptr, q_rope_ptr,
        kv_ptr, words_ptr, rope_ptr, aux_ptr, scale_ptr, rope_scale_ptr,
        block_tables_ptr, seq_lens_ptr,
        part_out_ptr, part_lse_ptr,
        qk_scale_log2,
        H, R, P, block_size, num_splits,
        stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
        stride_kv_blk, stride_kv_tok, stride_w_blk, stride_w_tok, stride_rope_blk, stride_rope_tok, stride_aux_blk, stride_aux_tok,
        stride_bt_b,
        stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h,
        MODE: tl.constexpr, ROPE_MODE: tl.constexpr,
        AUX_GROUP: tl.constexpr, AUX_BROADCAST: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
        LATENT_LOADS: tl.constexpr, WORD_PLANES: tl.constexpr, PLANES: tl.constexpr,
    ):
        """An MODE_NVFP4 latent is computed on even/odd feature halves (``load_nvfp4_halves``):
        q.c = q[0::2].c_even + q[1::2].c_odd and out[0::2] / out[1::2] accumulate separately, so the
        packed nibbles never need re-interleaving. Its RoPE rows are plain (16/32-bit) or, with ROPE_MODE
        MODE_FP8, e4m3 codes whose scores take ``rope_scale`` (the kv scale) before they join the latent's.
        LATENT_LOADS 2: QK^T takes a second load of the latent tile, transposed (``[BLOCK_R, BLOCK_N]``, or
        two ``[BLOCK_R // 2, BLOCK_N]`` halves), and its RoPE tile in that layout; P@V takes the first.
        WORD_PLANES: the latent is read as 16-bit words (``words_ptr``: the latent as int16) and computed on
        the words' byte planes (MODE_FP8: even/odd features, ``load_fp8_byte_planes``) or nibble planes (MODE_NVFP4:
        features q mod 4, ``load_nvfp4_nibble_planes``); RoPE as before. PLANES: how many feature planes the
        latent's dots run on (1: whole rows; 2: even/odd; 4: features q mod 4), the same for q and the output."""
        b = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(2)
        h_mask = offs_h < H
        HALF: tl.constexpr = BLOCK_R // 2
        QUARTER: tl.constexpr = BLOCK_R // 4
        # QK^T's operands: LATENT_LOADS 2 reads them in its transposed layout ([features, tokens]),
        # the latent a second time; P@V takes the latent as [tokens, features]
        QK_T: tl.constexpr = LATENT_LOADS == 2

        start, end = split_token_range(seq_lens_ptr, b, split, num_splits, BLOCK_N)

        # dot operands: fp32 (IEEE) or rounded once to bf16/fp16 for tensor cores
        qn_rows = q_nope_ptr + b * stride_qn_b + offs_h[:, None] * stride_qn_h
        q_rope, qr_scale = load_query_rows(q_rope_ptr + b * stride_qr_b + offs_h[:, None] * stride_qr_h, h_mask,
                                           P, 1, DOT_DTYPE, BLOCK_P)
        scale = tl.load(scale_ptr)  # fp8 tensor scale or nvfp4 global scale (unused for plain and fp8_tile)
        rope_scale = tl.load(rope_scale_ptr)  # an e4m3 RoPE part apart from an nvfp4 latent (else unused)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        if PLANES == 4:  # (q_even, q_odd, acc_even, acc_odd: planes 0 and 1; q_2, q_3, acc_2, acc_3: 2 and 3)
            q_even, qn_scale = load_query_rows(qn_rows, h_mask, R // 4, 4, DOT_DTYPE, QUARTER)
            q_odd, qn_scale = load_query_rows(qn_rows + 1, h_mask, R // 4, 4, DOT_DTYPE, QUARTER)
            q_2, qn_scale = load_query_rows(qn_rows + 2, h_mask, R // 4, 4, DOT_DTYPE, QUARTER)
            q_3, qn_scale = load_query_rows(qn_rows + 3, h_mask, R // 4, 4, DOT_DTYPE, QUARTER)
            acc_even = tl.zeros([BLOCK_H, QUARTER], tl.float32)
            acc_odd = tl.zeros([BLOCK_H, QUARTER], tl.float32)
            acc_2 = tl.zeros([BLOCK_H, QUARTER], tl.float32)
            acc_3 = tl.zeros([BLOCK_H, QUARTER], tl.float32)
        elif PLANES == 2:
            q_even, qn_scale = load_query_rows(qn_rows, h_mask, R // 2, 2, DOT_DTYPE, HALF)
            q_odd, qn_scale = load_query_rows(qn_rows + 1, h_mask, R // 2, 2, DOT_DTYPE, HALF)
            acc_even = tl.zeros([BLOCK_H, HALF], tl.float32)
            acc_odd = tl.zeros([BLOCK_H, HALF], tl.float32)
        else:
            q_nope, qn_scale = load_query_rows(qn_rows, h_mask, R, 1, DOT_DTYPE, BLOCK_R)
            acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n_mask, phys, slot = tile_slots(block_tables_ptr + b * stride_bt_b, n0, end, block_size, BLOCK_N)
            kv_off = phys * stride_kv_blk + slot * stride_kv_tok
            aux_off = phys * stride_aux_blk + slot * stride_aux_tok
            w_off = phys * stride_w_blk + slot * stride_w_tok
            if PLANES == 4:
                c_even, c_odd, c_2, c_3 = load_nvfp4_nibble_planes(words_ptr, w_off, n_mask, R, aux_ptr, aux_off,
                                                                   AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_R)
                qk = dot_scores(q_even, qn_scale, c_even, DOT_DTYPE, DOT_PRECISION)
                qk += dot_scores(q_odd, qn_scale, c_odd, DOT_DTYPE, DOT_PRECISION)
                qk += dot_scores(q_2, qn_scale, c_2, DOT_DTYPE, DOT_PRECISION)
                qk += dot_scores(q_3, qn_scale, c_3, DOT_DTYPE, DOT_PRECISION)
                qk = qk * (scale * NVFP4_TINY)  # the global scale (and the planes' 2^14), on the latent's scores only
            elif WORD_PLANES:
                c_even, c_odd = load_fp8_byte_planes(words_ptr, w_off, n_mask, R, DOT_DTYPE, BLOCK_N, BLOCK_R)
                qk = dot_scores(q_even, qn_scale, c_even, DOT_DTYPE, DOT_PRECISION)
                qk += dot_scores(q_odd, qn_scale, c_odd, DOT_DTYPE, DOT_PRECISION)
            elif MODE == 3:
                c_even, c_odd = load_nvfp4_halves(
                    kv_ptr, kv_off, n_mask, R, aux_ptr, aux_off, AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_R, False
                )
                if QK_T:
                    ct_even, ct_odd = load_nvfp4_halves(
                        kv_ptr, kv_off, n_mask, R, aux_ptr, aux_off, AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_R, True
                    )
                else:
                    ct_even, ct_odd = tl.trans(c_even), tl.trans(c_odd)
                qk = dot_scores_t(q_even, qn_scale, ct_even, DOT_DTYPE, DOT_PRECISION)
                qk += dot_scores_t(q_odd, qn_scale, ct_odd, DOT_DTYPE, DOT_PRECISION)
                # the global scale multiplies the latent's scores (not RoPE's) and, below, its output
                qk = qk * scale
            else:
                latent = load_kv_tile(
                    kv_ptr, kv_off, n_mask, R, aux_ptr, aux_off,
                    MODE, AUX_GROUP, AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_R, False,
                )
                if QK_T:
                    latent_t = load_kv_tile(
                        kv_ptr, kv_off, n_mask, R, aux_ptr, aux_off,
                        MODE, AUX_GROUP, AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_R, True,
                    )
                else:
                    latent_t = tl.trans(latent)
                qk = dot_scores_t(q_nope, qn_scale, latent_t, DOT_DTYPE, DOT_PRECISION)
            # only QK^T reads the RoPE tile: with QK_T it is loaded in that layout, no second load
            rope_t = load_kv_tile(
                rope_ptr, phys * stride_rope_blk + slot * stride_rope_tok, n_mask, P, aux_ptr, aux_off,
                ROPE_MODE, AUX_GROUP, AUX_BROADCAST, DOT_DTYPE, BLOCK_N, BLOCK_P, QK_T,
            )
            if not QK_T:
                rope_t = tl.trans(rope_t)
            rope_qk = dot_scores_t(q_rope, qr_scale, rope_t, DOT_DTYPE, DOT_PRECISION)
            if MODE == 3 and ROPE_MODE == 1:  # e4m3 RoPE codes: their own scale on the fp32 dots
                rope_qk = rope_qk * rope_scale
            qk += rope_qk
            if MODE == 1:  # fp8 row (latent and RoPE): the tensor scale, applied to the scores
                qk = qk * scale
            p, alpha, m_i, l_i = online_softmax_step(qk, n_mask, m_i, l_i, qk_scale_log2)
            p = probs_operand(p, DOT_DTYPE)
            if PLANES >= 2:
                acc_even = acc_even * alpha[:, None] + tl.dot(p, c_even, input_precision=DOT_PRECISION)
                acc_odd = acc_odd * alpha[:, None] + tl.dot(p, c_odd, input_precision=DOT_PRECISION)
            if PLANES == 4:
                acc_2 = acc_2 * alpha[:, None] + tl.dot(p, c_2, input_precision=DOT_PRECISION)
                acc_3 = acc_3 * alpha[:, None] + tl.dot(p, c_3, input_precision=DOT_PRECISION)
            if PLANES == 1:
                acc = acc * alpha[:, None] + tl.dot(p, latent, input_precision=DOT_PRECISION)

        l_safe = finish_softmax(m_i, l_i, part_lse_ptr + b * stride_pl_b + offs_h * stride_pl_h + split, h_mask)
        out_rows = part_out_ptr + b * stride_po_b + offs_h[:, None] * stride_po_h + split * stride_po_s
        if PLANES == 4:
            n4, tiny_scale = R // 4, scale * NVFP4_TINY
            store_partial_output(out_rows, acc_even, l_safe, tiny_scale, h_mask, n4, 4, MODE, DOT_DTYPE, QUARTER)
            store_partial_output(out_rows + 1, acc_odd, l_safe, tiny_scale, h_mask, n4, 4, MODE, DOT_DTYPE, QUARTER)
            store_partial_output(out_rows + 2, acc_2, l_safe, tiny_scale, h_mask, n4, 4, MODE, DOT_DTYPE, QUARTER)
            store_partial_output(out_rows + 3, acc_3, l_safe, tiny_scale, h_mask, n4, 4, MODE, DOT_DTYPE, QUARTER)
        elif PLANES == 2:
            store_partial_output(out_rows, acc_even, l_safe, scale, h_mask, R // 2, 2, MODE, DOT_DTYPE, HALF)
            store_partial_output(out_rows + 1, acc_odd, l_safe, scale, h_mask, R // 2, 2, MODE, DOT_DTYPE, HALF)
        else:
            store_partial_output(out_rows, acc, l_safe, scale, h_mask, R, 1, MODE, DOT_DTYPE, BLOCK_R)


def _check_decode_inputs(q_nope, q_rope, cache: MLACacheLayer, block_tables, seq_lens, softmax_scale) -> None:
    check_decode(cache, MLACacheLayer, (q_nope, q_rope), block_tables, seq_lens, softmax_scale)
    if q_nope.shape[2] != cache.kv_lora_rank or q_rope.shape[2] != cache.rope_dim:
        raise KVConvertError(
            f"query dims {q_nope.shape[2]}+{q_rope.shape[2]} do not match the cache's "
            f"kv_lora_rank {cache.kv_lora_rank} + rope_dim {cache.rope_dim}"
        )


def _latent_words(cache: MLACacheLayer, opts: DecodeOptions, block_r: int) -> tuple[torch.Tensor, int]:
    """(what the kernel reads a word_planes latent from, its PLANES constexpr). word_planes: the fp8 rows or
    the packed NVFP4 latent as int16 words, on 2 byte planes or 4 nibble planes; otherwise the data itself
    (unused) and 2 planes for NVFP4's even/odd halves, 1 for whole rows."""
    if not opts.word_planes:
        return cache.data, 2 if cache.mode == "nvfp4" else 1
    planes = {"fp8": 2, "nvfp4": 4}.get(cache.mode)
    if planes is None or (cache.mode == "fp8" and cache.data.dtype != FP8_DTYPE):
        raise KVConvertError(f"word_planes reads an fp8 (e4m3) or nvfp4 latent as 16-bit words, not a {cache.mode!r} "
                             f"cache of {cache.data.dtype}: drop the option")
    if opts.latent_loads != 1 or opts.dot == "fp8":
        raise KVConvertError("word_planes computes on feature planes: it takes latent_loads=1 and bf16/fp16/fp32 "
                             "dots (fp8 dots quantize whole query rows)")
    if cache.kv_lora_rank % 2 or cache.data.shape[-1] % 2 or block_r // planes < 16:
        raise KVConvertError(f"word_planes needs an even row width and kv_lora_rank > {8 * planes} (its planes are "
                             f"dot operands of at least 16 features), got {cache.kv_lora_rank}")
    return cache.data.view(torch.int16), planes


def paged_mla_decode_triton(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: MLACacheLayer,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
                            **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton split-KV MLA decode + LSE merge -> (out ``[B, H, R]`` q dtype, lse ``[B, H]`` fp32).
    options: :class:`~kvconvert.kernels._launch.DecodeOptions`."""
    require_triton()
    _check_decode_inputs(q_nope, q_rope, cache, block_tables, seq_lens, softmax_scale)
    opts = DecodeOptions(**options)
    data = cache.data
    check_kernel_device(q_nope, q_rope, data, block_tables, seq_lens)
    heads, r = q_nope.shape[1:]
    p = cache.rope_dim
    block_r, block_p = max(16, next_power_of_2(r)), max(16, next_power_of_2(p))
    mode = MODE_IDS[cache.mode]
    if cache.mode in ("none", "fp8"):
        rope, rope_mode = data[..., r:], mode  # RoPE sits in the same row, same encoding
    else:
        rope, rope_mode = cache.rope, MODE_FP8 if cache.rope_fp8 else MODE_PLAIN
    aux = cache.scales if cache.scales is not None else data
    aux_group = {"fp8_tile": r // aux.shape[-1], "nvfp4": 16}.get(cache.mode, 16)
    scale = cache.tensor_scale if cache.tensor_scale is not None else torch.ones(1, device=data.device)
    rope_scale = cache.rope_scale if cache.rope_fp8 else scale

    head_groups = triton.cdiv(heads, opts.block_h)
    part_out, part_lse = split_outputs(q_nope, r, head_groups, block_tables, cache.block_size, opts)
    splits = part_out.shape[2]
    # NVFP4: even/odd halves of BLOCK_R // 2 features, block-scale groups of 8 bytes
    words, planes = _latent_words(cache, opts, block_r)
    # NVFP4 block-scale groups: 8 bytes of even/odd halves, or 4 words of nibble planes
    if mode == MODE_NVFP4:
        broadcast = aux_broadcastable(16 // planes, block_r // planes)
    else:
        broadcast = aux_broadcastable(aux_group, block_r)
    _mla_decode_split_kernel[(q_nope.shape[0], head_groups, splits)](
        q_nope, q_rope, data, words, rope, aux, scale, rope_scale, block_tables, seq_lens, part_out, part_lse,
        check_softmax_scale(softmax_scale) * LOG2E,
        heads, r, p, cache.block_size, splits,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1),
        data.stride(0), data.stride(1), words.stride(0), words.stride(1), rope.stride(0), rope.stride(1), aux.stride(0), aux.stride(1),
        block_tables.stride(0),
        *partial_strides(part_out, part_lse),
        MODE=mode, ROPE_MODE=rope_mode, AUX_GROUP=aux_group, AUX_BROADCAST=broadcast,
        **dot_constexprs(resolve_dot(opts.dot, q_nope, cache)), BLOCK_R=block_r, BLOCK_P=block_p,
        LATENT_LOADS=opts.latent_loads, WORD_PLANES=opts.word_planes, PLANES=planes, **opts.launch,
    )
    return merge_splits(part_out, part_lse, q_nope.dtype)


def paged_mla_decode_reference(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: MLACacheLayer,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference (float64 on the dequantized cache): same contract as the Triton launcher."""
    _check_decode_inputs(q_nope, q_rope, cache, block_tables, seq_lens, softmax_scale)

    def attend(b, latent, rope):  # [n, R], [n, P] -> scores [H, n], values [n, R]
        return softmax_scale * (q_nope[b].double() @ latent.T + q_rope[b].double() @ rope.T), latent

    return decode_reference(q_nope, cache, block_tables, seq_lens, cache.kv_lora_rank, attend)
