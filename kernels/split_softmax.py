"""Split-KV online-softmax pieces shared by the decode kernels (``@triton.jit`` helpers, inlined).

A program owns one range of a sequence's tokens (whole BLOCK_N tiles), walks it tile by tile with
an online softmax in base 2 (scores pre-multiplied by ``softmax_scale * log2(e)``) and stores its
un-merged output and its natural-log LSE; :mod:`.merge` combines the ranges.
"""

from __future__ import annotations

from ._triton_compat import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def split_token_range(seq_lens_ptr, b, split, num_splits, BLOCK_N: tl.constexpr):
        """``[start, end)`` of this program's tokens: sequence b cut into num_splits ranges of whole tiles."""
        seq_len = tl.load(seq_lens_ptr + b)
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        return start, tl.minimum(start + per_split, seq_len)

    @triton.jit
    def paged_slots(table_row_ptr, offs_n, n_mask, block_size):
        """int64 (physical block, slot in the block) of each logical token in ``offs_n``."""
        phys = tl.load(table_row_ptr + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
        return phys, (offs_n % block_size).to(tl.int64)

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
    def finish_softmax(m_i, l_i):
        """(normalizer, natural-log LSE). An empty range (l_i == 0) gets normalizer 1, so its output
        stores as 0, and LSE -inf, so the merge gives it weight 0."""
        nonempty = l_i > 0
        l_safe = tl.where(nonempty, l_i, 1.0)
        # ln(2) literal: a @jit function may only read module globals that are tl.constexpr
        return l_safe, tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
