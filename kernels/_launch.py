"""Launcher helpers shared by the kernels: backend and input checks, split-KV buffers and merge, dot
precision, and the float64 decode reference loop."""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch

from kvconvert.errors import KVConvertError
from kvconvert.number_formats import FP8_DTYPE

from ._triton_compat import interpreter_enabled
from .dequant import DOT_PRECISIONS
from .merge import merge_lse_triton

LOG2E = 1.4426950408889634
FP8_DOT_MIN_BLOCK_N = 32  # an fp8 dot's K is at least 32, and P@V's K is block_n
BACKENDS = ("triton", "torch")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise KVConvertError(f"unknown kernel backend {backend!r}: use 'triton' or 'torch'")


def with_backend(launcher, reference):
    """The public form of a kernel: ``f(*args, backend='triton' | 'torch', **options)`` runs the Triton
    ``launcher(*args, **options)`` or its PyTorch ``reference`` with the options it takes (the kernel
    options, e.g. num_splits, dot, block_h, block_n, num_warps, num_stages, are Triton's only)."""
    reference_options = inspect.signature(reference).parameters

    @functools.wraps(launcher)
    def run(*args, backend: str = "triton", **options):
        check_backend(backend)
        if backend == "torch":
            return reference(*args, **{k: v for k, v in options.items() if k in reference_options})
        return launcher(*args, **options)

    run.__name__ = run.__qualname__ = launcher.__name__.removesuffix("_triton")  # paged_mla_decode, ...
    return run


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


def check_decode(cache, layout: type, queries: tuple[torch.Tensor, ...], block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, softmax_scale) -> None:
    """What every decode launcher and reference checks first: the softmax scale, the cache's layout
    class, queries ``[batch, heads, dim]`` contiguous in their last dim, and the paging."""
    check_softmax_scale(softmax_scale)
    if not isinstance(cache, layout):
        raise KVConvertError(f"cache must be a {layout.__name__}, got {type(cache).__name__}")
    if any(q.dim() != 3 or q.shape[:2] != queries[0].shape[:2] for q in queries):
        raise KVConvertError(f"queries {[tuple(q.shape) for q in queries]} must be [batch, heads, dim]")
    if any(q.stride(-1) != 1 for q in queries):
        raise KVConvertError("queries must be contiguous in their last dim")
    check_paging(block_tables, seq_lens, queries[0].shape[0], cache.block_size)


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


def resolve_dot(dot: str | None, q: torch.Tensor, cache) -> str:
    """Dot operand precision: 'fp32' on CPU (interpreter: bf16 is wrong there), 'bf16' on GPUs; 'fp8'
    only on request and only for an fp8 cache in e4m3 (its bytes are the operand as stored)."""
    if dot is None:
        dot = "fp32" if q.device.type == "cpu" else "bf16"
    if dot not in DOT_PRECISIONS:
        raise KVConvertError(f"unknown dot precision {dot!r}: choose one of {DOT_PRECISIONS}")
    if dot == "fp8" and (cache.mode != "fp8" or cache.block_tensors()[0].dtype != FP8_DTYPE):
        raise KVConvertError(
            f"dot='fp8' needs an fp8 cache in float8_e4m3fn (its bytes feed the matrix unit as stored), "
            f"not a {cache.mode!r} cache of {cache.block_tensors()[0].dtype}: use dot='bf16' or 'fp16'"
        )
    return dot


def e4m3_query_rows(q: torch.Tensor) -> torch.Tensor:
    """What dot='fp8' makes of queries ``[..., D]``, dequantized: each row rounded to e4m3 with its own
    scale amax / 448 (``formats.fp8_tile_quantize`` with one tile per row; the kernels'
    ``quantize_rows_e4m3`` is bit-exact with it), in q's dtype. The references given these queries
    see the scores the fp8 dots compute."""
    from kvconvert import number_formats as F

    return F.fp8_tile_dequantize(*F.fp8_tile_quantize(q, tile=q.shape[-1])).to(q.dtype)


@dataclass(frozen=True)
class DecodeOptions:
    """The decode launchers' keyword options (defaults as tuned on an H100). num_splits: KV ranges
    per sequence (None: default_num_splits); dot: operand precision (None: resolve_dot's default);
    block_h: query heads per program (64 and num_warps 4 or 8 let Hopper's wgmma take the dots; below
    64 they run on mma.sync); block_n: tokens per KV tile; num_warps, num_stages: Triton's;
    latent_loads (MLA): 1 reads each latent tile once for both dots, 2 reads it a second time in the
    transposed layout for QK^T (twice the loads, the second mostly from L2, so that neither dot's
    operand goes through a register transpose; the RoPE tile is then also read transposed);
    word_planes (fp8 and nvfp4 caches; MLA's latent, GQA's K and V): the rows read as 16-bit words and
    computed on their byte planes (fp8: even/odd features) or nibble planes (nvfp4: features q mod 4), so the
    P@V operand, the tile transposed, is not read back from shared memory byte by byte (kvconvert.kernels.dequant.load_fp8_byte_planes,
    load_nvfp4_nibble_planes; docs/BENCHMARKS.md "Kernels")."""

    num_splits: int | None = None
    dot: str | None = None
    block_h: int = 16
    block_n: int = 16
    num_warps: int = 4
    num_stages: int = 2
    latent_loads: int = 1
    word_planes: bool = False

    def __post_init__(self):
        if self.block_h < 16 or self.block_n < 16:
            raise KVConvertError("block_h and block_n must be >= 16 (tl.dot tile shapes)")
        if self.latent_loads not in (1, 2):
            raise KVConvertError(f"latent_loads must be 1 or 2, not {self.latent_loads!r}")
        if self.dot == "fp8" and self.block_n < FP8_DOT_MIN_BLOCK_N:
            raise KVConvertError(f"dot='fp8' needs block_n >= {FP8_DOT_MIN_BLOCK_N}: an fp8 dot's K is at least "
                                 f"{FP8_DOT_MIN_BLOCK_N}, and P@V's K is block_n")

    @property
    def launch(self) -> dict[str, int]:
        """The launch keywords every decode kernel takes."""
        return {"BLOCK_H": self.block_h, "BLOCK_N": self.block_n, "num_warps": self.num_warps,
                "num_stages": self.num_stages}


def split_outputs(q: torch.Tensor, width: int, head_groups: int, block_tables: torch.Tensor, block_size: int,
                  options: DecodeOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's buffers for q ``[batch, heads, ...]``: part_out fp32 ``[batch, heads, splits, width]``
    and part_lse fp32 ``[batch, heads, splits]`` (splits: options.num_splits or the default for the grid)."""
    batch, heads = q.shape[:2]
    max_context = block_tables.shape[1] * block_size
    splits = options.num_splits or default_num_splits(batch, head_groups, max_context, options.block_n)
    part_out = torch.empty(batch, heads, splits, width, dtype=torch.float32, device=q.device)
    return part_out, torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)


def partial_strides(part_out: torch.Tensor, part_lse: torch.Tensor) -> tuple[int, ...]:
    """The kernels' stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h arguments."""
    return (*part_out.stride()[:3], *part_lse.stride()[:2])


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: the ranges merged by LSE -> (out ``[batch, heads, width]`` out_dtype, lse fp32 ``[batch, heads]``)."""
    if part_out.shape[2] == 1:
        return part_out[:, :, 0].to(out_dtype).contiguous(), part_lse[:, :, 0].contiguous()
    return merge_lse_triton(part_out, part_lse, out_dtype=out_dtype)


def decode_reference(q: torch.Tensor, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor, width: int,
                     attend) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode references' float64 loop, for q ``[batch, heads, ...]`` -> (out ``[batch, heads, width]``
    in q's dtype, lse fp32 ``[batch, heads]``; 0 and -inf for an empty sequence).

    Per sequence b of n > 0 tokens, the dequantized cache tensors as token rows ``[n, ...]`` float64
    go to ``attend(b, *rows)`` -> (scores ``[heads, n]``, values ``[n, width]`` or ``[heads, n, width]``).
    """
    batch, heads = q.shape[:2]
    out = torch.zeros(batch, heads, width, dtype=torch.float64, device=q.device)
    lse = torch.full((batch, heads), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        # dequantize only this sequence's blocks (the cache may be much larger than the batch)
        blocks = block_tables[b, : -(-n // cache.block_size)].long()
        rows = (t.reshape(-1, *t.shape[2:])[:n].double() for t in cache.select_blocks(blocks).dequantize())
        scores, values = attend(b, *rows)
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = (torch.softmax(scores, dim=-1)[:, None, :] @ values).squeeze(-2)
    return out.to(q.dtype), lse.float()
