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
    small part of the row and carries the position signal.
  * nvfp4_fp8rope (MLA only): the latent as nvfp4, the k_rope tail e4m3 with the row's kv scale.
  * int8: TensorRT-LLM's INT8 cache, int8 codes of x * (1 / scale) (round half to even, saturating), read back
    as float(q) * scale; scale = amax / 127 per tensor (per KV head accepted), and one scale for K and V,
    max(k_scale, v_scale), as TensorRT-LLM applies (kvformat's shared_kv_scale). The torch backend reads it.
The storage is kvconvert.kernels.cache_layout's layer objects (one per layer), so the Triton
kernels read the runtime's cache as is and the torch backend gathers from the same tensors.
Formats, scale conventions and scale names are kvconvert.kvformat's: the checkpoint's kv_scale is
amax / 448 for FP8 E4M3 and NVFP4, amax / 57344 for FP8 E5M2, amax / 127 for INT8 (what kv_scales="dynamic"
derives too), under the vLLM / compressed-tensors name (model.layers.N.self_attn.k_scale, .v_scale), the
ModelOpt / TensorRT-LLM one (self_attn.k_proj.k_scale, .v_proj.v_scale) or vLLM's shared kv_scale.
An MLA checkpoint has one scale for the whole cached row: self_attn.k_scale (v_scale equal), or
the ModelOpt-style self_attn.kv_a_proj_with_mqa.k_scale.
Quantization uses the layers' (kvconvert.number_formats, bit-exact references) on write and on read.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from kvconvert.errors import KVConvertError
from kvconvert.ggml_formats import llamacpp_frames
from kvconvert.kernels.cache_layout import GQACacheLayer, MLACacheLayer, dequantize_rows
from kvconvert.kvformat import RUNTIME_KV_DTYPES, SHARED_SCALE_SUFFIX, KVFormat, check_kv_dtype, kv_format, kv_pair, scale_names
from kvconvert.targets import check_llamacpp_shape


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
    rope_tail: the last rope_tail values of the row are MLA's RoPE key, which nvfp4 keeps apart (bf16, or
    e4m3 for nvfp4_fp8rope).
    """

    row_shape: tuple[int, ...]
    rope_tail: int = 0


def make_layer(kv_dtype: str, num_blocks: int, block_size: int, specs: dict[str, CacheSpec],
               scales: dict[str, torch.Tensor], dynamic: bool = False, device: torch.device | str = "cpu"):
    """One layer's storage, a kvconvert.kernels cache layer: MLACacheLayer for a {"kv": row} layout,
    GQACacheLayer for {"k", "v"}. Dynamic scales start as placeholders, set by the first write."""
    pair = checked_pair(kv_dtype, [specs])
    if pair.ggml_types:  # llama.cpp's cache as the engine stores it, in its frames (K's type, V's type)
        return _ggml_layer(*pair.ggml_types, num_blocks, block_size, specs, device)
    fmt = pair.k
    # int8; fp8 e4m3 or e5m2; none; nvfp4
    mode = "int8" if fmt.integer else "fp8" if fmt.quantized and fmt.torch_dtype else fmt.kernel_mode
    # nvfp4: the RoPE tail's dtype (bf16, or e4m3 for nvfp4_fp8rope)
    dtype = getattr(torch, fmt.torch_dtype or kv_format(fmt.mla_rope or "bf16").torch_dtype)
    placeholder = 1.0 if fmt.quantized else None
    spec = next(iter(specs.values()))
    if "kv" in specs:
        rank = spec.row_shape[0] - spec.rope_tail
        layer = MLACacheLayer.allocate(mode, num_blocks, block_size, rank, spec.rope_tail, dtype=dtype, device=device,
                                       kv_scale=scales.get("kv", placeholder))
    else:
        layer = GQACacheLayer.allocate(mode, num_blocks, block_size, *spec.row_shape, dtype=dtype, device=device,
                                       k_scale=scales.get("k", placeholder), v_scale=scales.get("v", placeholder))
    layer.dynamic_format = fmt if dynamic and fmt.quantized else None
    return layer


def checked_pair(kv_dtype: str, layout: list[dict[str, CacheSpec]]):
    """The KVPair of `kv_dtype` (one of RUNTIME_KV_DTYPES or a K/V pair of them), refused before any work when the
    model's cache cannot hold it: an MLA-only layout for per-head K/V, a mixed pair for MLA, or a shape llama.cpp
    does not serve its block types for (kvconvert.targets' one rule: the runtime measures only what it serves)."""
    try:
        pair = kv_pair(check_kv_dtype(kv_dtype, RUNTIME_KV_DTYPES))
    except ValueError as exc:
        raise KVConvertError(f"kv_dtype {kv_dtype!r} is not supported; choose one of {', '.join(RUNTIME_KV_DTYPES)}, "
                             f"or a K/V pair KTYPE/VTYPE of llama.cpp's types ({exc})") from None
    spec = next(iter(layout[0].values())) if layout and layout[0] else None
    if spec is None:
        return pair
    mla = "kv" in layout[0]
    pair.check_cache_kind(mla)
    if mla:
        rank = spec.row_shape[0] - spec.rope_tail
        check_llamacpp_shape(pair.name, True, rank=rank, rope_dim=spec.rope_tail)
    else:
        check_llamacpp_shape(pair.name, False, head_dim=spec.row_shape[-1])
    return pair


def _ggml_layer(k_type: str, v_type: str, num_blocks: int, block_size: int, specs: dict[str, CacheSpec], device):
    """A llama.cpp-format layer: its K type and V type (one type for an MLA row), and the frames the engine
    quantizes in (its channel order and Hadamard rotation, on unless LLAMA_ATTN_ROT_DISABLE=1, as in llama.cpp)."""
    spec = next(iter(specs.values()))
    if "kv" in specs:
        width = spec.row_shape[0]
        frames = llamacpp_frames(k_type, k_type, width, mla=True)
        return MLACacheLayer.allocate("ggml", num_blocks, block_size, width - spec.rope_tail, spec.rope_tail,
                                      device=device, frames=frames)
    kv_heads, head_dim = spec.row_shape
    frames = llamacpp_frames(k_type, v_type, head_dim, mla=False)
    return GQACacheLayer.allocate("ggml", num_blocks, block_size, kv_heads, head_dim, device=device, frames=frames)


def rows_to_write(layer, first: torch.Tensor, second: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(storage tensor, encoded rows [T, ...]) pairs for new tokens (GQA: k, v [T, kv_heads, head_dim];
    MLA: latent [T, R], k_rope [T, P]); a dynamic layer first takes its scales from them."""
    fmt = layer.dynamic_format
    if fmt is not None:
        if isinstance(layer, MLACacheLayer):  # one scale for the whole row [latent | k_rope]
            layer.set_kv_scales(_dynamic_scale(fmt, first, second))
        elif fmt.shared_kv_scale:  # K and V at one scale, as the engine stores them
            layer.set_kv_scales(*[_dynamic_scale(fmt, first, second)] * 2)
        else:
            layer.set_kv_scales(_dynamic_scale(fmt, first), _dynamic_scale(fmt, second))
        layer.dynamic_format = None
    return layer.quantize_rows(first, second)


def _dynamic_scale(fmt: KVFormat, *parts: torch.Tensor) -> float:
    """A per-tensor kv scale (fmt.scale_from_amax) from the amax of the first rows written."""
    amax = max(float(x.detach().abs().amax()) for x in parts)
    if not math.isfinite(amax):
        raise KVConvertError("non-finite K/V values in the first prefill: cannot derive a dynamic KV scale")
    return fmt.scale_from_amax(amax) if amax > 0 else 1.0  # an all-zero tensor leaves any positive scale exact


def write(layer, first: torch.Tensor, second: torch.Tensor, slots: torch.Tensor,
          workspace: Workspace | None = None) -> None:
    """Store new tokens (as rows_to_write) at flat slots [T] (slot = block * block_size + offset); a layer with a
    decoded copy (add_decoded_copy) also gets the rows read back from what was stored, at the same slots."""
    for dst, rows in rows_to_write(layer, first, second):
        if dst.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # CPU index_copy_ lacks float8: copy bytes
            dst, rows = dst.view(torch.uint8), rows.view(torch.uint8)
        dst.view(dst.shape[0] * dst.shape[1], *dst.shape[2:]).index_copy_(0, slots, rows)
    for name, copy in (getattr(layer, "decoded", None) or {}).items():
        flat = copy.view(copy.shape[0] * copy.shape[1], *copy.shape[2:])
        flat.index_copy_(0, slots, _read_slots(layer, name, slots, copy.dtype, workspace or Workspace(copy.device)))


def add_decoded_copy(layer, dtype: torch.dtype) -> None:
    """Give a quantized layer a decoded copy of its cache: per quantity ("k", "v"; MLA "kv") a tensor
    [num_blocks, block_size, *row_shape] in `dtype`, filled as rows are written (write) with what reading them back
    from the stored cache gives. gather then copies from it instead of dequantizing every block of the context
    again at each step (llama.cpp's types: a table lookup and the inverse Hadamard per value, most of a 4K-context
    decode step's time). Costs dtype's bytes per cached value beside the stored cache; an unquantized layer needs
    none (its storage is the values)."""
    if layer.mode == "none":
        return
    names = ("kv",) if isinstance(layer, MLACacheLayer) else ("k", "v")
    nb, bs = layer.block_tensors()[0].shape[:2]
    layer.decoded = {n: torch.zeros(nb, bs, *layer.row_shape, dtype=dtype, device=layer.device) for n in names}


def decoded_bytes_per_token(layout: list[dict[str, CacheSpec]], kv_dtype: str, dtype: torch.dtype) -> int:
    """Bytes a decoded copy (add_decoded_copy) takes per token over all layers: every cached value in dtype; 0 for
    an unquantized kv_dtype, which gets none."""
    if not kv_pair(kv_dtype).quantized:
        return 0
    return sum(math.prod(spec.row_shape) for layer in layout for spec in layer.values()) * dtype.itemsize


def _read_slots(layer, name: str, slots: torch.Tensor, dtype: torch.dtype, workspace: Workspace) -> torch.Tensor:
    """Rows at flat slots [T] of quantity `name`, read back from the stored cache as gather reads them: [T, *row]."""
    values, block_scales, scale, rope = layer.stored(name)
    rows = lambda t: None if t is None else t.view(t.shape[0] * t.shape[1], *t.shape[2:]).index_select(0, slots)[None]
    out = torch.empty(1, len(slots), *layer.row_shape, dtype=dtype, device=slots.device)
    return _dequantize(layer, name, rows(values), rows(block_scales), scale, rows(rope), out, workspace)[0]


def gather(layer, name: str, block_tables: torch.Tensor, out: torch.Tensor, workspace: Workspace) -> torch.Tensor:
    """Read quantity `name` ("k", "v" or MLA's "kv") of blocks block_tables [B, n] back, dequantized
    (kvconvert.kernels.cache_layout's reference dequant; from the decoded copy when the layer has one), into
    out [B, n * block_size, *row_shape] (any float dtype and strides, e.g. a transposed view of a heads-first
    buffer); returns out."""
    copy = getattr(layer, "decoded", None)
    if copy is not None:
        return out.copy_(_gather_blocks(copy[name], block_tables, workspace, "decoded"))
    values, block_scales, scale, rope = layer.stored(name)
    gathered = lambda t, key: None if t is None else _gather_blocks(t, block_tables, workspace, key)
    return _dequantize(layer, name, gathered(values, "raw"), gathered(block_scales, "raw_scales"), scale,
                       gathered(rope, "raw_rope"), out, workspace)


def _dequantize(layer, name: str, raw: torch.Tensor, block_scales: torch.Tensor | None, scale: torch.Tensor | None,
                rope: torch.Tensor | None, out: torch.Tensor, workspace: Workspace) -> torch.Tensor:
    """Stored rows raw [B, S, ...] (their block scales and MLA rope tail gathered alike) -> values in
    out [B, S, *row_shape]; returns out."""
    if layer.mode == "none":
        return out.copy_(raw)
    if layer.mode == "ggml":
        return out.copy_(layer.read_rows(raw, name))
    lead = out if rope is None else out[..., : -rope.shape[-1]]
    if layer.mode in ("fp8", "int8"):  # every decode step reads the whole context: the table, not per-value casts
        lead.copy_(code_table_dequantize(raw, scale, out.dtype, workspace))
    else:
        lead.copy_(dequantize_rows(layer.mode, raw, scale, block_scales, out.dtype))
    if rope is not None:
        out[..., -rope.shape[-1]:].copy_(layer.dequantize_rope(rope, out.dtype))
    return out


def code_table_dequantize(raw: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                          workspace: Workspace) -> torch.Tensor:
    """8-bit codes raw [..., H, D] (or MLA rows [..., W]; FP8 or INT8) times scale ([1, 1], [H, 1] or [1]) in
    out_dtype: bit for bit kvconvert.number_formats.fp8_dequantize / int8_dequantize (each value float(code) * scale
    in fp32, then rounded once to out_dtype), read from a table of the 256 codes' products instead. A byte has 256 values, so the table holds
    every product the per-value path can form; the lookup is one integer gather, about 4x faster on a CPU than
    PyTorch's per-value float8 cast, which dominated an FP8 cache's decode step (docs/BENCHMARKS.md)."""
    codes = torch.arange(256, dtype=torch.int32, device=raw.device).to(torch.uint8).view(raw.dtype).float()
    per_row = scale.reshape(-1, 1).float()  # one table per KV head (per-head scales) or one for the tensor
    table = (codes[None, :] * per_row).to(out_dtype).reshape(-1)  # [heads * 256]
    index = workspace.get("fp8_index", tuple(raw.shape), torch.int32)
    index.copy_(raw.view(torch.uint8))
    if per_row.shape[0] > 1:  # head h's codes index its own table, at h * 256
        index.view(-1, *raw.shape[-2:]).add_(torch.arange(per_row.shape[0], dtype=torch.int32,
                                                          device=raw.device)[:, None] * 256)
    flat = workspace.get("fp8_values", (index.numel(),), out_dtype)
    return torch.index_select(table, 0, index.reshape(-1), out=flat).view(raw.shape)


def _gather_blocks(t: torch.Tensor, block_tables: torch.Tensor, workspace: Workspace, name: str) -> torch.Tensor:
    """Raw storage rows of the blocks: [B, n * block_size, ...] in t's dtype (a workspace buffer)."""
    b, n = block_tables.shape
    # index_select: a plain row gather, several times faster on CPU than advanced indexing
    raw = torch.index_select(t, 0, block_tables.reshape(-1), out=workspace.get(name, (b * n, *t.shape[1:]), t.dtype))
    return raw.view(b, n * t.shape[1], *t.shape[2:])


def bytes_per_token(layout: list[dict[str, CacheSpec]], kv_dtype: str) -> int:
    """Exact cache bytes one token takes over all layers (constant per-tensor scales excluded):
    kvconvert.kvformat's vector_bytes per cached row, as the planner (kvconvert.kvmath) counts; a K/V pair counts
    each quantity in its half's format (an MLA row: K's)."""
    pair = checked_pair(kv_dtype, layout)
    return sum(math.prod(spec.row_shape[:-1]) * pair.side(name).vector_bytes(spec.row_shape[-1], spec.rope_tail)
               for layer in layout for name, spec in layer.items())


class PagedKVCache:
    """All layers' storage: layers[i] is a kvconvert.kernels cache layer (GQACacheLayer: k and v;
    MLACacheLayer: the [latent | k_rope] row), the layout the Triton kernels read and the torch
    backend gathers from. Every storage tensor and kv scale lives on `device`. decoded_dtype: give each quantized
    layer a decoded copy in that dtype (add_decoded_copy; the torch backend reads it)."""

    def __init__(self, layout: list[dict[str, CacheSpec]], num_blocks: int, block_size: int,
                 kv_dtype: str, scales: list[dict[str, torch.Tensor]] | None = None, dynamic: bool = False,
                 device: torch.device | str = "cpu", decoded_dtype: torch.dtype | None = None):
        self.num_blocks, self.block_size, self.kv_dtype = num_blocks, block_size, kv_dtype
        self.device = torch.device(device)
        scales = scales or [{} for _ in layout]
        self.layers = [make_layer(kv_dtype, num_blocks, block_size, specs, scales[i], dynamic, self.device)
                       for i, specs in enumerate(layout)]
        if decoded_dtype is not None:  # read back from a decoded copy (add_decoded_copy)
            for layer in self.layers:
                add_decoded_copy(layer, decoded_dtype)

    @property
    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token for layer in self.layers)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = (torch.tensor(i, dtype=torch.long, device=self.device) for i in zip(*copies))
        for layer in self.layers:
            for t in [*layer.block_tensors(), *(getattr(layer, "decoded", None) or {}).values()]:
                t[dst] = t[src]


# ------------------------------------------------------------------------------ scales
def read_kv_scales(reader, layout: list[dict[str, CacheSpec]], kv_dtype: str, source: str
                   ) -> tuple[list[dict[str, torch.Tensor]], bool]:
    """Per-layer kv scales for a quantized cache: ([{name: scale}], dynamic).

    A scale is a 0-d fp32 tensor (per tensor) or [kv_heads, 1] (per head). With source
    "checkpoint" every layer must have them (KVConvertError otherwise); with "dynamic" they are
    computed from the first prefill and a warning says so. A format whose engine stores K and V at one
    scale (int8: kvformat's shared_kv_scale) gets max(k_scale, v_scale) for both.
    """
    if not kv_pair(kv_dtype).has_kv_scale:  # unquantized, or llama.cpp's types (scales set per block)
        return [{} for _ in layout], False
    if source == "dynamic":
        warnings.warn(
            f"kv_scales='dynamic': {kv_dtype} KV scales are computed from the amax of the first prefill step "
            f"({kv_format(kv_dtype).scale_rule}, per tensor); later, larger values are clipped. Calibrated checkpoint "
            "scales are the reliable source (kvconvert calibrate).", stacklevel=3)
        return [{} for _ in layout], True
    scales = [{name: _read_scale(reader, i, name, spec.row_shape, kv_dtype) for name, spec in layer.items()}
              for i, layer in enumerate(layout)]
    fmt = kv_format(kv_dtype)  # int8: K and V at the larger of the two, as TensorRT-LLM stores them
    return [dict(zip("kv", fmt.engine_scales(s["k"], s["v"]))) if "v" in s else s for s in scales], False


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
        raise KVConvertError(f"{reader.path}: {found} has a zero, negative or non-finite value; "
                             "recalibrate the KV scales")
    if scale.numel() == 1:
        return scale.reshape(())
    heads = row_shape[0] if len(row_shape) == 2 else None
    if heads is not None and scale.numel() == heads:
        return scale.reshape(heads, 1)
    raise KVConvertError(
        f"{reader.path}: {found} has shape {tuple(scale.shape)}; expected one value"
        + (f" or one per KV head ({heads})" if heads else " (MLA caches one row: per-tensor scale only)")
    )
