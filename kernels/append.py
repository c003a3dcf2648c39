"""KV append: scatter already-quantized rows (bytes, scales, 16-bit values) into a paged cache.

Layout: ``cache [num_blocks, block_size, *row]`` (any dtype; the row's elements contiguous),
``rows [num_tokens, *row]`` of the same dtype, ``slot_mapping`` int64 ``[num_tokens]`` with
``slot = block * block_size + offset``; a slot of -1 skips that token. Quantization happens before,
in PyTorch (``kvconvert.number_formats``): fp32 -> fp8 casts inside Triton kernels are not reliable
in the interpreter, and scattering bytes makes the write bit-exact by construction.

The kernel copies raw bits through the widest integer view (int32, int16 or uint8) that the row
width allows, so one kernel serves fp8 codes, packed NVFP4, e4m3/fp32 scales and bf16 RoPE rows.
"""

from __future__ import annotations

import torch

from kvconvert.errors import KVConvertError

from ._launch import with_backend
from ._triton_compat import HAS_TRITON, check_kernel_device, next_power_of_2, require_triton, tl, triton

if HAS_TRITON:

    @triton.jit
    def _kv_append_kernel(
        rows_ptr,
        cache_ptr,
        slot_ptr,
        row_width,
        stride_rows,
        stride_cache_block,
        stride_cache_slot,
        block_size,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        slot = tl.load(slot_ptr + token)
        block = slot // block_size
        dst = cache_ptr + block * stride_cache_block + (slot % block_size) * stride_cache_slot + offs
        # slot broadcast to the tile before the compare (a scalar & tensor mask trips the interpreter)
        mask = (offs < row_width) & ((offs * 0 + slot) >= 0)
        values = tl.load(rows_ptr + token.to(tl.int64) * stride_rows + offs, mask=mask)
        tl.store(dst, values, mask=mask)


def _bit_view(t: torch.Tensor, width_bytes: int) -> tuple[torch.Tensor, int]:
    """View t's last-dim bytes as the widest integer type that divides the row; returns (view, width)."""
    for dtype, size in ((torch.int32, 4), (torch.int16, 2), (torch.uint8, 1)):
        if width_bytes % size == 0 and t.storage_offset() * t.element_size() % size == 0:
            try:
                return t.view(torch.uint8).view(dtype), width_bytes // size
            except RuntimeError:  # strides not divisible: fall through to a narrower type
                continue
    raise KVConvertError("cannot view the cache rows as bytes: make them contiguous in the row dims")


def _check_append(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if cache.dim() < 3:
        raise KVConvertError(f"cache must be [num_blocks, block_size, *row], got {tuple(cache.shape)}")
    if tuple(rows.shape[1:]) != tuple(cache.shape[2:]) or rows.dtype != cache.dtype:
        raise KVConvertError(
            f"rows {tuple(rows.shape)} {rows.dtype} do not match cache rows {tuple(cache.shape[2:])} {cache.dtype}: "
            "quantize them with the cache layer's quantize_rows first"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (rows.shape[0],):
        raise KVConvertError(f"slot_mapping must be int64 [num_tokens={rows.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if slot_mapping.numel() and int(slot_mapping.max()) >= cache.shape[0] * cache.shape[1]:
        raise KVConvertError(f"slot_mapping has a slot >= num_blocks * block_size = {cache.shape[0] * cache.shape[1]}")
    if slot_mapping.numel() and int(slot_mapping.min()) < -1:
        raise KVConvertError("slot_mapping holds a negative slot other than -1 (skip)")


def _row_major(t: torch.Tensor, lead: int) -> bool:
    """The dims after the first ``lead`` are contiguous (row-major)."""
    return t[(0,) * lead].is_contiguous() if t.numel() else True


def kv_append_triton(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, check_slots: bool = True) -> None:
    """Scatter ``rows[t]`` to ``cache`` slot ``slot_mapping[t]`` (skip -1), bit-exact, in place.

    ``check_slots`` validates slot ranges on the host (one sync); pass False on a hot path.
    """
    require_triton()
    if check_slots:
        _check_append(cache, rows, slot_mapping)
    check_kernel_device(cache, rows, slot_mapping)
    if rows.shape[0] == 0:
        return
    if not _row_major(cache, 2) or not _row_major(rows, 1):
        raise KVConvertError("kv_append needs each cache slot and each new row contiguous")
    row_bytes = rows[0].numel() * rows.element_size()
    flat_cache = cache.view(cache.shape[0], cache.shape[1], -1)  # a view: writes land in the cache
    flat_rows = rows.reshape(rows.shape[0], -1)
    cache_bits, width = _bit_view(flat_cache, row_bytes)
    rows_bits, width_rows = _bit_view(flat_rows.contiguous(), row_bytes)
    if width_rows != width:  # alignment differs: copy bytes
        cache_bits, width = flat_cache.view(torch.uint8), row_bytes
        rows_bits = flat_rows.contiguous().view(torch.uint8)
    block = min(1024, max(16, next_power_of_2(width)))
    grid = (rows.shape[0], triton.cdiv(width, block))
    _kv_append_kernel[grid](
        rows_bits, cache_bits, slot_mapping, width,
        rows_bits.stride(0), cache_bits.stride(0), cache_bits.stride(1), cache.shape[1],
        BLOCK=block,
    )


def kv_append_reference(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """PyTorch reference of :func:`kv_append_triton` (index_copy on the flattened slots)."""
    _check_append(cache, rows, slot_mapping)
    keep = slot_mapping >= 0
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    flat[slot_mapping[keep]] = rows[keep]


# kv_append(cache, rows, slot_mapping, backend="triton"): the kernel or its reference
kv_append = with_backend(kv_append_triton, kv_append_reference)
