"""Split-KV online-softmax pieces shared by the decode kernels (``@triton.jit`` helpers, inlined).

A program owns one range of a sequence's tokens (whole BLOCK_N tiles) and a block of BLOCK_H query
heads, walks the range tile by tile with an online softmax in base 2 (scores pre-multiplied by
``softmax_scale * log2(e)``) and stores its un-merged output and its natural-log LSE; :mod:`.merge`
combines the ranges. Head rows (queries, partial outputs) are addressed by ``[BLOCK_H, 1]`` pointers
to each row's first feature and read or written whole (STEP 1) or as even/odd features (STEP 2,
the second from ``rows + 1``: the NVFP4 kernels' halves).
"""

from __future__ import annotations

from ._triton_compat import HAS_TRITON, tl, triton

if HAS_TRITON:
    from .dequant import P_SCALE_FP8, quantize_rows_e4m3

    @triton.jit
    def split_token_range(seq_lens_ptr, b, split, num_splits, BLOCK_N: tl.constexpr):
        """``[start, end)`` of this program's tokens: sequence b cut into num_splits ranges of whole tiles."""
        seq_len = tl.load(seq_lens_ptr + b)
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        return start, tl.minimum(start + per_split, seq_len)

    @triton.jit
    def tile_slots(table_row_ptr, n0, end, block_size, BLOCK_N: tl.constexpr):
        """Tokens ``n0 .. n0 + BLOCK_N`` of a sequence -> (mask: below end, int64 physical block, int64 slot
        in the block), from the sequence's block table row."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        phys = tl.load(table_row_ptr + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
        return n_mask, phys, (offs_n % block_size).to(tl.int64)

    @triton.jit
    def load_head_rows(rows_ptr, h_mask, n, STEP: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
        """Features ``0, STEP, 2 * STEP, ...`` (n of them) of each head row -> ``[BLOCK_H, BLOCK]`` in OUT_DTYPE
        (upcast to fp32 right after the load, then the dot operand dtype); masked heads and padding read 0."""
        offs = tl.arange(0, BLOCK)
        x = tl.load(rows_ptr + STEP * offs[None, :], mask=h_mask[:, None] & (offs < n)[None, :], other=0.0)
        return x.to(tl.float32).to(OUT_DTYPE)

    @triton.jit
    def load_query_rows(rows_ptr, h_mask, n, STEP: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
        """Query rows as a dot operand -> (``[BLOCK_H, BLOCK]`` in DOT_DTYPE, the scale its scores carry):
        :func:`load_head_rows` and scale 1.0, except for fp8 dots, where each head row is quantized to
        e4m3 with its own fp32 scale ``[BLOCK_H]`` (:func:`~.dequant.quantize_rows_e4m3`)."""
        # one return statement: compiled Triton requires every return of a function to have one type
        if DOT_DTYPE == tl.float8e4nv:
            rows, scale = quantize_rows_e4m3(load_head_rows(rows_ptr, h_mask, n, STEP, tl.float32, BLOCK))
        else:
            rows, scale = load_head_rows(rows_ptr, h_mask, n, STEP, DOT_DTYPE, BLOCK), 1.0
        return rows, scale

    @triton.jit
    def dot_scores(q, q_scale, tile, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """q ``[BLOCK_H, D]`` . tile ``[BLOCK_N, D]`` -> fp32 ``[BLOCK_H, BLOCK_N]``, times the query rows'
        scale when they were quantized (fp8 dots; :func:`load_query_rows`)."""
        return dot_scores_t(q, q_scale, tl.trans(tile), DOT_DTYPE, DOT_PRECISION)

    @triton.jit
    def dot_scores_t(q, q_scale, tile_t, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """:func:`dot_scores` on a tile already transposed, ``[D, BLOCK_N]`` (e.g. loaded in that layout)."""
        s = tl.dot(q, tile_t, input_precision=DOT_PRECISION)
        if DOT_DTYPE == tl.float8e4nv:
            s = s * q_scale[:, None]
        return s

    @triton.jit
    def store_head_rows(rows_ptr, x, h_mask, n, STEP: tl.constexpr, BLOCK: tl.constexpr):
        """Inverse of :func:`load_head_rows`: x ``[BLOCK_H, BLOCK]`` to features ``0, STEP, ...`` (n of them)."""
        offs = tl.arange(0, BLOCK)
        tl.store(rows_ptr + STEP * offs[None, :], x, mask=h_mask[:, None] & (offs < n)[None, :])

    @triton.jit
    def store_partial_output(rows_ptr, acc, l_safe, value_scale, h_mask, n, STEP: tl.constexpr, MODE: tl.constexpr,
                             DOT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
        """A range's normalized output ``acc / l`` to its head rows (:func:`store_head_rows`), after the
        factors the kernels keep out of their inner loop: the values' scalar scale (MODE_FP8 raw fp8,
        MODE_NVFP4 values without their global scale) and fp8 dots' probability scale."""
        if MODE == 1 or MODE == 3:
            acc = acc * value_scale
        if DOT_DTYPE == tl.float8e4nv:
            acc = acc / P_SCALE_FP8
        store_head_rows(rows_ptr, acc / l_safe[:, None], h_mask, n, STEP, BLOCK)

    @triton.jit
    def online_softmax_step(qk, n_mask, m_i, l_i, qk_scale_log2):
        """One tile of scores ``[BLOCK_H, BLOCK_N]`` -> (p, alpha, m_new, l_new).

        p = 2^(s - m_new) with masked tokens at 0; the caller rescales its accumulator by alpha
        (= 2^(m_old - m_new)) before adding p @ V.
        """
        s = tl.where(n_mask[None, :], qk * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def finish_softmax(m_i, l_i, lse_ptrs, h_mask):
        """Stores the natural-log LSE ``[BLOCK_H]`` at lse_ptrs and returns the normalizer. An empty range
        (l_i == 0) gets normalizer 1, so its output stores as 0, and LSE -inf, so the merge gives it weight 0."""
        nonempty = l_i > 0
        l_safe = tl.where(nonempty, l_i, 1.0)
        # ln(2) literal: a @jit function may only read module globals that are tl.constexpr
        lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptrs, lse, mask=h_mask)
        return l_safe
