"""Launcher helpers shared by the decode kernels: input checks, split count, dot precision, gathers."""

from __future__ import annotations

import math

import torch

from kvconvert.errors import KVConvertError

from ._triton_compat import interpreter_enabled
from .dequant import DOT_PRECISIONS

LOG2E = 1.4426950408889634


def check_paging(block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: int, block_size: int) -> None:
    """Shapes/dtypes always; values only for CPU tensors (on a GPU that would cost a host sync per call,
    so there the caller guarantees 0 <= seq_lens <= max_blocks * block_size)."""
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise KVConvertError(f"block_tables must be int32 [batch={batch}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (batch,):
        raise KVConvertError(f"seq_lens must be int32 [batch={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if block_tables.stride(-1) != 1:
        raise KVConvertError("block_tables must be contiguous in its last dim")
    capacity = block_tables.shape[1] * block_size
    if seq_lens.device.type == "cpu" and batch and not bool(((seq_lens >= 0) & (seq_lens <= capacity)).all()):
        raise KVConvertError(f"seq_lens must lie in [0, max_blocks * block_size = {capacity}]: extend the block tables")


def check_softmax_scale(softmax_scale) -> float:
    """The softmax scale as a python float (a kernel argument must not be a tensor); positive, finite."""
    try:
        value = float(softmax_scale)
    except (TypeError, ValueError, RuntimeError):
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise KVConvertError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return value


def default_num_splits(batch: int, head_groups: int, max_context: int, block_n: int) -> int:
    """Enough programs to fill a GPU (~2 waves of 132 SMs), each range at least 256 tokens long."""
    if interpreter_enabled():  # CPU: every program costs ~20 ms of Python; 2 ranges still test the merge
        return max(1, min(2, math.ceil(max_context / (4 * block_n))))
    programs = batch * head_groups
    return max(1, min(math.ceil(264 / max(programs, 1)), math.ceil(max_context / 256), 64))


def resolve_dot(dot: str | None, q: torch.Tensor) -> str:
    """Dot operand precision: 'fp32' on CPU (interpreter: bf16 is wrong there), 'bf16' on GPUs."""
    if dot is None:
        dot = "fp32" if q.device.type == "cpu" else "bf16"
    if dot not in DOT_PRECISIONS:
        raise KVConvertError(f"unknown dot precision {dot!r}: choose one of {DOT_PRECISIONS}")
    return dot


def sequence_blocks(block_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Physical blocks holding a sequence's first ``seq_len`` tokens, in order (from its table row)."""
    return block_row[: -(-seq_len // block_size)].long()


def flatten_tokens(blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[n_blocks, block_size, ...]`` -> the first ``seq_len`` token rows ``[seq_len, ...]``."""
    return blocks.reshape(-1, *blocks.shape[2:])[:seq_len]
