"""Merge partial attention results by their log-sum-exp (split-KV second stage, prefix+suffix merge).

A part ``s`` of the keys gives ``o_s = sum_j softmax_j v_j`` over its keys and
``lse_s = log(sum_j exp(score_j))`` (natural log, scores already multiplied by the softmax scale;
``-inf`` for an empty part). The merged result over all parts is::

    m = max_s lse_s,  w_s = exp(lse_s - m),  out = sum_s w_s o_s / sum_s w_s,  lse = m + log(sum_s w_s)

with ``out = 0`` and ``lse = -inf`` when every part is empty.
Shapes: ``partial_out [..., S, D]`` (fp32), ``partial_lse [..., S]`` (fp32) -> ``out [..., D]``, ``lse [...]``.
"""

from __future__ import annotations

import torch

from kvconvert.errors import KVConvertError

from ._triton_compat import (
    HAS_TRITON, check_kernel_device, interpreter_enabled, next_power_of_2, require_triton, tl, triton,
)

if HAS_TRITON:

    @triton.jit
    def _merge_lse_kernel(
        part_ptr,
        part_lse_ptr,
        out_ptr,
        lse_ptr,
        ROWS,
        S,
        D,
        stride_part_row,
        stride_part_s,
        stride_plse_row,
        stride_out_row,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program: BLOCK_ROWS rows x BLOCK_D features, all S parts ([rows, S, D] tiles)."""
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        r_mask = rows < ROWS
        rs_mask = r_mask[:, None] & (offs_s < S)[None, :]
        rows64 = rows.to(tl.int64)
        lse = tl.load(part_lse_ptr + rows64[:, None] * stride_plse_row + offs_s[None, :], mask=rs_mask, other=float("-inf"))
        m = tl.max(lse, 1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m_safe[:, None])  # [rows, S]; empty parts (-inf) weigh 0
        w_sum = tl.sum(w, 1)
        w_safe = tl.where(w_sum > 0, w_sum, 1.0)  # all parts empty: every weight is 0, so out is 0
        ptrs = part_ptr + rows64[:, None, None] * stride_part_row + offs_s[None, :, None] * stride_part_s
        parts = tl.load(ptrs + offs_d[None, None, :], mask=rs_mask[:, :, None] & (offs_d < D)[None, None, :], other=0.0)
        merged = tl.sum(parts * w[:, :, None], 1) / w_safe[:, None]
        out_mask = r_mask[:, None] & (offs_d < D)[None, :]
        tl.store(out_ptr + rows64[:, None] * stride_out_row + offs_d[None, :], merged.to(out_ptr.dtype.element_ty), mask=out_mask)
        if tl.program_id(1) == 0:
            tl.store(lse_ptr + rows64, tl.where(w_sum > 0, m_safe + tl.log(w_safe), float("-inf")), mask=r_mask)


def _check_merge(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> None:
    if partial_out.dim() < 2 or tuple(partial_lse.shape) != tuple(partial_out.shape[:-1]):
        raise KVConvertError(
            f"partial_out {tuple(partial_out.shape)} must be [..., S, D] and partial_lse {tuple(partial_lse.shape)} [..., S]"
        )
    if partial_out.dtype != torch.float32 or partial_lse.dtype != torch.float32:
        raise KVConvertError("merge_lse expects fp32 partial outputs and LSEs")


def merge_lse_triton(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton merge: ``[..., S, D]`` + ``[..., S]`` -> (out ``[..., D]`` out_dtype, lse ``[...]`` fp32)."""
    require_triton()
    _check_merge(partial_out, partial_lse)
    check_kernel_device(partial_out, partial_lse)
    lead, (s, d) = partial_out.shape[:-2], partial_out.shape[-2:]
    parts = partial_out.reshape(-1, s, d).contiguous()
    lses = partial_lse.reshape(-1, s).contiguous()
    rows = parts.shape[0]
    out = torch.empty(rows, d, dtype=out_dtype, device=parts.device)
    lse = torch.empty(rows, dtype=torch.float32, device=parts.device)
    if rows:
        block_s = max(2, next_power_of_2(s))
        # GPU: small tiles, many programs; interpreter: few large programs (per-program cost dominates)
        block_rows, block_d_cap = (16, 1024) if interpreter_enabled() else (2, 128)
        block_d = min(block_d_cap, max(16, next_power_of_2(d)))
        grid = (triton.cdiv(rows, block_rows), triton.cdiv(d, block_d))
        _merge_lse_kernel[grid](
            parts, lses, out, lse, rows, s, d, parts.stride(0), parts.stride(1), lses.stride(0), out.stride(0),
            BLOCK_ROWS=block_rows, BLOCK_S=block_s, BLOCK_D=block_d,
        )
    return out.reshape(*lead, d), lse.reshape(lead)


def merge_lse_reference(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`merge_lse_triton` (float64 inside)."""
    _check_merge(partial_out, partial_lse)
    lse = partial_lse.double()
    m = lse.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    w_sum = w.sum(-1, keepdim=True)
    out = (partial_out.double() * w[..., None]).sum(-2) / torch.where(w_sum > 0, w_sum, torch.ones_like(w_sum))
    merged_lse = torch.where(w_sum > 0, m + torch.log(w_sum), torch.full_like(w_sum, float("-inf")))
    return out.to(out_dtype), merged_lse.squeeze(-1).float()
