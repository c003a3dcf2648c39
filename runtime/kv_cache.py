"""The paged KV cache's storage: per layer, one tensor per cached quantity, in blocks.

Layouts (row = what one token caches in one layer):
  * Llama (MHA/GQA): "k" and "v", each [num_blocks, block_size, kv_heads, head_dim], post-RoPE k.
  * DeepSeek-V3 MLA: "kv", [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]: the latent
    after kv_a_layernorm, then k_rope after RoPE (one shared head).
Storage formats (kv_dtype):
  * bf16 / fp16 / fp32: the values, cast.
  * fp8 / fp8_e4m3 / fp8_e5m2: x / scale cast to fp8 (RNE, saturating), one byte per value; scale
    per tensor or per KV head (shape [kv_heads, 1]); read back as float(q) * scale.
  * nvfp4: per row, packed E2M1 codes uint8 [..., D/2] + e4m3 scale per 16 values [..., D/16] +
    global scale kv_scale / 6 (per tensor or per head). For MLA only the latent is NVFP4; the
    k_rope tail stays bf16 ([num_blocks, block_size, rope]) like FlashMLA's layout, since it is a
    small part of the row and carries the position signal. This is the layout of
    kvconvert.kernels.cache_layout, so the Triton kernels read the runtime's cache as is.
Formats, scale conventions and scale names are kvconvert.kvformat's: the checkpoint's kv_scale is
amax / 448 for FP8 E4M3 and NVFP4, amax / 57344 for FP8 E5M2 (what kv_scales="dynamic" derives
too), under the vLLM / compressed-tensors name (model.layers.N.self_attn.k_scale, .v_scale), the
ModelOpt / TensorRT-LLM one (self_attn.k_proj.k_scale, .v_proj.v_scale) or vLLM's shared kv_scale.
An MLA checkpoint has one scale for the whole cached row: self_attn.k_scale (v_scale equal), or
the ModelOpt-style self_attn.kv_a_proj_with_mqa.k_scale.
Quantization uses kvconvert.quant.formats (bit-exact references) on write and on read.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import RUNTIME_KV_DTYPES, SHARED_SCALE_SUFFIX, KVFormat, kv_format, scale_names
from kvconvert.quant.formats import (
    fp8_dequantize,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_global_scale_from_kv_scale,
    nvfp4_quantize,
)


class Workspace:
    """Reusable scratch buffers keyed by name and dtype, grown on demand.

    A fresh large CPU allocation page-faults on first touch; reusing buffers made a decode
    step's cache reads several times faster than allocating new tensors each layer. A buffer is
    valid until the next get() of the same key, so callers consume it before asking again.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._buffers.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=self.device)
            self._buffers[(name, dtype)] = buf
        return buf[:n].view(shape)


@dataclass(frozen=True)
class CacheSpec:
    """What one token caches for one quantity of one layer.

    row_shape: e.g. (kv_heads, head_dim) for Llama k/v, (kv_lora_rank + rope,) for MLA.
    rope_tail: the last rope_tail values of the row are a RoPE key kept in bf16 by nvfp4 (MLA).
    """

    row_shape: tuple[int, ...]
    rope_tail: int = 0


class KVStore(ABC):
    """One cached quantity of one layer: logical shape [num_blocks, block_size, *row_shape].

    encode(x) turns new rows into (storage tensor, encoded rows) pairs; write scatters them to
    slots; gather reads blocks back, dequantized.
    """

    def __init__(self, num_blocks: int, block_size: int, spec: CacheSpec, device: torch.device):
        self.num_blocks, self.block_size, self.spec, self.device = num_blocks, block_size, spec, device
        self.row_shape = spec.row_shape

    def _zeros(self, *row: int, dtype: torch.dtype) -> torch.Tensor:
        """A storage tensor [num_blocks, block_size, *row] on the cache's device."""
        return torch.zeros(self.num_blocks, self.block_size, *row, dtype=dtype, device=self.device)

    def tensors(self) -> list[torch.Tensor]:
        """The storage tensors, each [num_blocks, block_size, ...] (one, `data`, unless a store has more)."""
        return [self.data]

    @property
    def bytes_per_token(self) -> int:
        return sum(t[0, 0].numel() * t.element_size() for t in self.tensors())

    @abstractmethod
    def encode(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """x [T, *row_shape] -> [(storage tensor, rows [T, ...] in its dtype)]."""

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store x [T, *row_shape] at flat slots [T] (slot = block * block_size + offset)."""
        for dst, rows in self.encode(x):
            if dst.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # CPU index_copy_ lacks float8: copy bytes
                dst, rows = dst.view(torch.uint8), rows.view(torch.uint8)
            dst.view(self.num_blocks * self.block_size, *dst.shape[2:]).index_copy_(0, slots, rows)

    @abstractmethod
    def gather(self, block_tables: torch.Tensor, out: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
        """Read blocks block_tables [B, n] back, dequantized, into out [B, n * block_size, *row_shape]
        (any float dtype and strides, e.g. a transposed view of a heads-first buffer); returns out."""

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        s, d = (torch.tensor(i, dtype=torch.long, device=self.device) for i in (src, dst))
        for t in self.tensors():
            t[d] = t[s]

    def _gather(self, t: torch.Tensor, block_tables: torch.Tensor, workspace: Workspace | None,
                name: str) -> torch.Tensor:
        """Raw storage rows of the blocks: [B, n * block_size, ...] in t's dtype."""
        b, n = block_tables.shape
        idx = block_tables.reshape(-1)
        # index_select: a plain row gather, several times faster on CPU than advanced indexing
        if workspace is None:
            raw = torch.index_select(t, 0, idx)
        else:
            raw = torch.index_select(t, 0, idx, out=workspace.get(name, (b * n, *t.shape[1:]), t.dtype))
        return raw.view(b, n * self.block_size, *t.shape[2:])


class FloatStore(KVStore):
    def __init__(self, num_blocks, block_size, spec, device, dtype: torch.dtype):
        super().__init__(num_blocks, block_size, spec, device)
        self.data = self._zeros(*spec.row_shape, dtype=dtype)

    def encode(self, x):
        return [(self.data, x.to(self.data.dtype))]

    def gather(self, block_tables, out, workspace=None):
        return out.copy_(self._gather(self.data, block_tables, workspace, "raw"))


class ScaledStore(KVStore):
    """A quantized store with a kv_scale (fmt.scale_from_amax): from the checkpoint, or, when
    dynamic, from the amax of the first tensor written (per tensor)."""

    def __init__(self, num_blocks, block_size, spec, device, fmt: KVFormat, kv_scale: torch.Tensor | None,
                 dynamic: bool):
        super().__init__(num_blocks, block_size, spec, device)
        self.fmt, self.dynamic = fmt, dynamic
        self.kv_scale = None if kv_scale is None else kv_scale.to(device)

    def _ensure_scale(self, x: torch.Tensor) -> None:
        if self.kv_scale is not None:
            return
        if not self.dynamic:
            raise KVConvertError("quantized KV cache has no scale (internal: scales are checked at load)")
        amax = float(x.detach().abs().amax())
        if not math.isfinite(amax):
            raise KVConvertError("non-finite K/V values in the first prefill: cannot derive a dynamic KV scale")
        # an all-zero tensor leaves any positive scale exact; use 1.0
        self.kv_scale = torch.tensor(self.fmt.scale_from_amax(amax) if amax > 0 else 1.0, dtype=torch.float32,
                                     device=self.device)


class FP8Store(ScaledStore):
    def __init__(self, num_blocks, block_size, spec, device, fmt, kv_scale, dynamic):
        super().__init__(num_blocks, block_size, spec, device, fmt, kv_scale, dynamic)
        self.data = self._zeros(*spec.row_shape, dtype=getattr(torch, fmt.torch_dtype))

    def encode(self, x):
        self._ensure_scale(x)
        return [(self.data, fp8_quantize(x, self.kv_scale, self.data.dtype))]

    def gather(self, block_tables, out, workspace=None):
        raw = self._gather(self.data, block_tables, workspace, "raw")
        return out.copy_(fp8_dequantize(raw, self.kv_scale, out.dtype))


class NVFP4Store(ScaledStore):
    """NVFP4 over the row (minus a bf16 RoPE tail, if the spec has one)."""

    def __init__(self, num_blocks, block_size, spec, device, fmt, kv_scale, dynamic):
        super().__init__(num_blocks, block_size, spec, device, fmt, kv_scale, dynamic)
        *lead, width = spec.row_shape
        d = width - spec.rope_tail
        if d % 16:
            raise KVConvertError(
                f"nvfp4 KV cache needs {'kv_lora_rank' if spec.rope_tail else 'head_dim'} divisible by 16, "
                f"got {d}; use fp8 instead"
            )
        self.quantized_width = d
        self.packed = self._zeros(*lead, d // 2, dtype=torch.uint8)
        self.block_scales = self._zeros(*lead, d // 16, dtype=torch.float8_e4m3fn)
        self.rope = self._zeros(spec.rope_tail, dtype=torch.bfloat16) if spec.rope_tail else None

    def tensors(self):
        return [self.packed, self.block_scales] + ([self.rope] if self.rope is not None else [])

    @property
    def global_scale(self) -> torch.Tensor:
        return nvfp4_global_scale_from_kv_scale(self.kv_scale)

    def encode(self, x):
        self._ensure_scale(x)
        d = self.quantized_width
        packed, scales = nvfp4_quantize(x[..., :d], self.global_scale)
        pairs = [(self.packed, packed), (self.block_scales, scales)]
        if self.rope is not None:
            pairs.append((self.rope, x[..., d:].to(self.rope.dtype)))
        return pairs

    def gather(self, block_tables, out, workspace=None):
        packed = self._gather(self.packed, block_tables, workspace, "raw")
        scales = self._gather(self.block_scales, block_tables, workspace, "raw_scales")
        d = self.quantized_width
        out[..., :d].copy_(nvfp4_dequantize(packed, scales, self.global_scale, out.dtype))
        if self.rope is not None:
            out[..., d:].copy_(self._gather(self.rope, block_tables, workspace, "raw_rope"))
        return out


def make_store(kv_dtype: str, num_blocks: int, block_size: int, spec: CacheSpec, kv_scale=None,
               dynamic: bool = False, device: torch.device | str = "cpu") -> KVStore:
    if kv_dtype not in RUNTIME_KV_DTYPES:
        raise KVConvertError(f"kv_dtype {kv_dtype!r} is not supported; choose one of {', '.join(RUNTIME_KV_DTYPES)}")
    fmt, device = kv_format(kv_dtype), torch.device(device)
    if not fmt.quantized:
        return FloatStore(num_blocks, block_size, spec, device, getattr(torch, fmt.torch_dtype))
    store = FP8Store if fmt.torch_dtype else NVFP4Store  # NVFP4: packed codes + block scales
    return store(num_blocks, block_size, spec, device, fmt, kv_scale, dynamic)


def bytes_per_token(layout: list[dict[str, CacheSpec]], kv_dtype: str) -> int:
    """Exact cache bytes one token takes over all layers (constant per-tensor scales excluded):
    kvconvert.kvformat's vector_bytes per cached row, as the planner (kvconvert.kvmath) counts."""
    fmt = kv_format(kv_dtype)
    return sum(math.prod(spec.row_shape[:-1]) * fmt.vector_bytes(spec.row_shape[-1], spec.rope_tail)
               for layer in layout for spec in layer.values())


class PagedKVCache:
    """All layers' stores. layers[i][name] is a KVStore; names come from the model's kv layout.
    Every storage tensor and kv scale lives on `device`."""

    def __init__(self, layout: list[dict[str, CacheSpec]], num_blocks: int, block_size: int,
                 kv_dtype: str, scales: list[dict[str, torch.Tensor]] | None = None, dynamic: bool = False,
                 device: torch.device | str = "cpu"):
        self.num_blocks, self.block_size, self.kv_dtype = num_blocks, block_size, kv_dtype
        self.device = torch.device(device)
        scales = scales or [{} for _ in layout]
        self.layers = [
            {name: make_store(kv_dtype, num_blocks, block_size, spec, scales[i].get(name), dynamic, self.device)
             for name, spec in layer.items()}
            for i, layer in enumerate(layout)
        ]

    @property
    def bytes_per_token(self) -> int:
        return sum(store.bytes_per_token for layer in self.layers for store in layer.values())

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = [s for s, _ in copies], [d for _, d in copies]
        for layer in self.layers:
            for store in layer.values():
                store.copy_blocks(src, dst)


# ------------------------------------------------------------------------------ scales
def read_kv_scales(reader, layout: list[dict[str, CacheSpec]], kv_dtype: str, source: str
                   ) -> tuple[list[dict[str, torch.Tensor]], bool]:
    """Per-layer kv scales for a quantized cache: ([{name: scale}], dynamic).

    A scale is a 0-d fp32 tensor (per tensor) or [kv_heads, 1] (per head). With source
    "checkpoint" every layer must have them (KVConvertError otherwise); with "dynamic" they are
    computed from the first prefill and a warning says so.
    """
    if not kv_format(kv_dtype).quantized:
        return [{} for _ in layout], False
    if source == "dynamic":
        warnings.warn(
            f"kv_scales='dynamic': {kv_dtype} KV scales are computed from the amax of the first prefill step "
            "(amax/448 per tensor, amax/57344 for e5m2); later, larger values are clipped. Calibrated checkpoint scales are "
            "the reliable source (kvconvert calibrate).",
            stacklevel=3,
        )
        return [{} for _ in layout], True
    scales = []
    for i, layer in enumerate(layout):
        scales.append({name: _read_scale(reader, i, name, spec.row_shape, kv_dtype) for name, spec in layer.items()})
    return scales, False


def _read_scale(reader, layer: int, name: str, row_shape: tuple[int, ...], kv_dtype: str) -> torch.Tensor:
    candidates = [*scale_names(name, layer), f"model.layers.{layer}.self_attn.{SHARED_SCALE_SUFFIX}"]
    found = next((c for c in candidates if c in reader), None)
    if found is None:
        raise KVConvertError(
            f"kv_dtype {kv_dtype} needs KV scales but {reader.path} has no {candidates[0]}"
            + (f" or {candidates[1]}" if len(candidates) > 1 else "")
            + ": calibrate them (kvconvert calibrate) or pass kv_scales='dynamic' (--kv-scales dynamic)"
        )
    scale = reader.get(found).float()
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise KVConvertError(f"{reader.path}: {found} has a zero, negative or non-finite value; recalibrate the KV scales")
    if scale.numel() == 1:
        return scale.reshape(())
    heads = row_shape[0] if len(row_shape) == 2 else None
    if heads is not None and scale.numel() == heads:
        return scale.reshape(heads, 1)
    raise KVConvertError(
        f"{reader.path}: {found} has shape {tuple(scale.shape)}; expected one value"
        + (f" or one per KV head ({heads})" if heads else " (MLA caches one row: per-tensor scale only)")
    )
