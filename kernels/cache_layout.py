"""Paged KV-cache layouts of one attention layer, shared by the kernels, their references and the runtime.

Paging (both layouts): a cache holds ``num_blocks`` blocks of ``block_size`` token slots.
``block_tables`` int32 ``[batch, max_blocks_per_seq]`` maps a sequence's i-th block to a physical
block; ``seq_lens`` int32 ``[batch]``; ``slot_mapping`` int64 ``[num_tokens]`` gives the slot
``block * block_size + offset`` a new token is written to (-1 = skip the token).

MLA (:class:`MLACacheLayer`), ``R = kv_lora_rank``, ``P = rope_dim``:

====================  ===========================================  ==============================
mode                  ``data``                                     extra tensors
====================  ===========================================  ==============================
``none``              fp32/fp16/bf16 ``[nb, bs, R + P]``           -
``fp8`` (per tensor)  float8_e4m3fn ``[nb, bs, R + P]``            ``tensor_scale`` fp32 ``[1]``
``fp8_tile``          float8_e4m3fn ``[nb, bs, R]``                ``scales`` fp32 ``[nb, bs, R // T]``,
                                                                   ``rope`` 16/32-bit ``[nb, bs, P]``
``nvfp4``             uint8 ``[nb, bs, R // 2]``                   ``scales`` e4m3 ``[nb, bs, R // 16]``,
                                                                   ``tensor_scale`` fp32 ``[1]`` (global),
                                                                   ``rope`` 16/32-bit ``[nb, bs, P]``,
                                                                   or e4m3 ``[nb, bs, P]`` with
                                                                   ``rope_scale`` fp32 ``[1]``
====================  ===========================================  ==============================

* ``fp8`` applies one dequant scale to the whole 576-value row, as vLLM does with ``k_scale``.
* ``fp8_tile`` is FlashMLA's layout: dynamic per-token scales ``amax / 448`` per tile of ``T``
  latent values (T = 128 for DeepSeek's 512), RoPE part kept in 16 bits. ``T`` is the largest
  divisor of R that is a multiple of 16 and at most 128 (R = 64 -> 64, 96 -> 96, 160 -> 80);
  any divisor works in the kernels, which read T from ``scales``' shape.
* ``nvfp4`` quantizes only the latent (blocks of 16, e4m3 block scales, fp32 global scale); the
  RoPE key stays 16-bit like FlashMLA's: it is 11% of the row and carries the position signal
  that 4-bit codes would blur. The global scale is the exported kv scale / 6 (docs/formats.md).
  With an e4m3 ``rope`` (kvformat ``nvfp4_fp8rope``: ``allocate(dtype=torch.float8_e4m3fn)``) k_rope is
  stored as ``fp8(k_rope / kv_scale)`` and ``rope_scale`` holds the exported kv scale itself: one byte
  per RoPE value, read back as ``float(code) * rope_scale``, the row's one scale as vLLM's fp8 MLA row.

GQA (:class:`GQACacheLayer`), ``k`` and ``v`` alike, ``H = kv_heads``, ``D = head_dim``:

* ``none``: fp32/fp16/bf16 ``[nb, bs, H, D]``.
* ``fp8``: float8_e4m3fn ``[nb, bs, H, D]``; ``k_scale``/``v_scale`` fp32 ``[1]`` (per tensor)
  or ``[H]`` (per head).
* ``nvfp4``: uint8 ``[nb, bs, H, D // 2]``; ``k_block_scales``/``v_block_scales`` e4m3
  ``[nb, bs, H, D // 16]``; ``k_scale``/``v_scale`` = global scale fp32 ``[1]`` or ``[H]``.

Scales passed to ``allocate`` / ``set_kv_scales`` are the exported kv scales (``amax / 448``) for FP8
and NVFP4 alike. ``fp8`` data may also be float8_e5m2 (``allocate(dtype=torch.float8_e5m2)``, scale
``amax / 57344``): the runtime's torch backend reads it; the Triton kernels are for e4m3.
These layer objects are the runtime's paged cache storage too (``kvconvert.runtime.kv_cache``).

``int8`` (both layouts; no kernel reads it): TensorRT-LLM's INT8 cache, int8 codes of ``x * (1 / scale)``
(kvconvert.number_formats.int8_quantize) where ``fp8`` has e4m3 ones: GQA ``k``/``v`` int8 ``[nb, bs, H, D]`` with
``k_scale``/``v_scale`` fp32 ``[1]`` or ``[H]`` (the exported amax / 127, the dequant scale); MLA ``data`` int8
``[nb, bs, R + P]`` with ``tensor_scale`` fp32 ``[1]``, the whole row at one scale.

``ggml`` (both layouts; no kernel reads it): llama.cpp's cache as the engine stores it, uint8 blocks of 32 values
``[..., width // 32, block_bytes]`` (GQA: ``[nb, bs, H, D // 32, bytes]`` for k and v, each with its own
``frames[side]``; MLA: ``data`` ``[nb, bs, (R + P) // 32, bytes]``, the whole row, ``frames["kv"]``). A frame
(kvconvert.ggml_formats.CacheFrame) holds the type and what the engine does before quantizing (channel order,
Hadamard rotation); reads map the values back to the model's frame.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvconvert.errors import KVConvertError
from kvconvert.ggml_formats import GGML_BLOCK, CacheFrame
from kvconvert.kvformat import KERNEL_MODES
from kvconvert import number_formats as F
from kvconvert.number_formats import FP8_DTYPE  # the e4m3 storage dtype, defined with the FP8 maths

GQA_MODES = KERNEL_MODES  # none, fp8, nvfp4: the registry formats' kernel modes
MLA_MODES = (*KERNEL_MODES, "fp8_tile")  # + FlashMLA's dynamic per-tile layout (no checkpoint format)
# storage the torch backend reads but no kernel does: "ggml", llama.cpp's block formats in its own cache frame
# (kvconvert.ggml_formats.CacheFrame: channel order, Hadamard, blocks of 32), the engine's bytes as it stores them
# and "int8", TensorRT-LLM's INT8 cache (kvconvert.number_formats.int8_quantize), read by the runtime's torch backend
EMULATED_MODES = ("ggml", "int8")
FP8_DTYPES = (FP8_DTYPE, torch.float8_e5m2)  # fp8 mode's data: e4m3 (the kernels' and the default) or e5m2
PLAIN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALED_MODES = ("fp8", "int8")  # one code per value at a kv scale (per tensor, per head, or the MLA row's)
VALUE_DTYPES = {"none": PLAIN_DTYPES, "fp8": FP8_DTYPES, "int8": (torch.int8,)}  # a value-per-element mode's data

# a mode's block tensors: {field: (shape, allowed dtypes)}; allocated in the requested dtype where allowed
# (PLAIN_DTYPES: the plain / RoPE dtype; FP8_DTYPES: e4m3 or e5m2), else in the first allowed
Layout = dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]


def mla_fp8_tile(kv_lora_rank: int) -> int:
    """FP8 tile size for ``fp8_tile``: the largest divisor of R that is a multiple of 16 and <= 128."""
    for tile in range(min(128, kv_lora_rank) // 16 * 16, 0, -16):
        if kv_lora_rank % tile == 0:
            return tile
    raise KVConvertError(f"kv_lora_rank {kv_lora_rank} has no FP8 tile (multiple of 16 dividing it): use a multiple of 16")


def _expect(t: torch.Tensor | None, name: str, shape: tuple, dtypes: tuple) -> None:
    if t is None:
        raise KVConvertError(f"{name} is required for this cache mode")
    if tuple(t.shape) != tuple(shape):
        raise KVConvertError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.dtype not in dtypes:
        raise KVConvertError(f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if t.stride(-1) != 1:
        raise KVConvertError(f"{name} must be contiguous in its last dim (call .contiguous())")


def _frame(frames: dict[str, CacheFrame] | None, side: str) -> CacheFrame:
    if not frames or side not in frames:
        raise KVConvertError(f"a ggml cache needs its frames (kvconvert.ggml_formats.llamacpp_frames), {side!r} missing")
    return frames[side]


def _scale_tensor(scale, n: int, what: str, device) -> torch.Tensor:
    """fp32 ``[1]`` or ``[n]`` positive finite scale."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1).clone()
    if s.numel() not in (1, n):
        raise KVConvertError(f"{what} must have 1 or {n} values, got {s.numel()}")
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise KVConvertError(f"{what} must be positive and finite: recalibrate the KV scales")
    return s


def _stored_scale(mode: str, kv_scale, n: int, what: str, device) -> torch.Tensor:
    """A mode's fp32 ``[1]`` or ``[n]`` scale from an exported kv scale: fp8's dequant scale as is,
    nvfp4's global scale = kv_scale / 6."""
    s = _scale_tensor(kv_scale, n, what, device)
    return F.nvfp4_global_scale_from_kv_scale(s) if mode == "nvfp4" else s


def _quantize(mode: str, x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> list[torch.Tensor]:
    """New rows x in a mode's stored form: [values] ("none": cast to dtype; "fp8": in fp8 dtype; "int8": int8
    codes) or [packed codes, block scales] ("nvfp4", scale = the global scale)."""
    if mode == "none":
        return [x.to(dtype)]
    if mode == "fp8":
        return [F.fp8_quantize(x, scale, dtype)]
    if mode == "int8":
        return [F.int8_quantize(x, scale)]
    return list(F.nvfp4_quantize(x, scale))


def dequantize_rows(mode: str, values: torch.Tensor, scale: torch.Tensor | None = None,
                    block_scales: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`_quantize` (the kernels' reference dequant), in out_dtype: each value in fp32,
    rounded once to out_dtype ("none": cast straight to out_dtype)."""
    if mode == "none":
        return values.to(out_dtype)
    if mode == "fp8":
        return F.fp8_dequantize(values, scale, out_dtype)
    if mode == "int8":
        return F.int8_dequantize(values, scale, out_dtype)
    return F.nvfp4_dequantize(values, block_scales, scale, out_dtype)


class _PagedLayer:
    """What both layouts share: the paging sizes, the append and block selection.
    BLOCK_FIELDS: the tensors indexed by block, ``[num_blocks, block_size, ...]`` (the first always set)."""

    BLOCK_FIELDS: tuple[str, ...] = ()
    mode: str
    # the runtime's kv_scales="dynamic": the format whose scale_from_amax sets the kv scales from the
    # first rows written (kvconvert.runtime.kv_cache); None once set, or for calibrated scales
    dynamic_format = None

    @property
    def num_blocks(self) -> int:
        return getattr(self, self.BLOCK_FIELDS[0]).shape[0]

    @property
    def block_size(self) -> int:
        return getattr(self, self.BLOCK_FIELDS[0]).shape[1]

    @property
    def device(self) -> torch.device:
        return getattr(self, self.BLOCK_FIELDS[0]).device

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies: every component (values, block scales, RoPE)."""
        return sum(t[0, 0].numel() * t.element_size() for t in self.block_tensors())

    def _check_tensors(self, layout: Layout) -> None:
        for field, (shape, dtypes) in layout.items():
            _expect(getattr(self, field), f"{type(self).__name__} {self.mode} {field}", shape, dtypes)

    @staticmethod
    def _zeros(layout: Layout, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
        """Zeroed block tensors of a layout, each in ``dtype`` where allowed, else its first allowed dtype."""
        return {field: torch.zeros(shape, dtype=dtype if dtype in dtypes else dtypes[0], device=device)
                for field, (shape, dtypes) in layout.items()}

    def block_tensors(self) -> list[torch.Tensor]:
        """The tensors indexed by block, each ``[num_blocks, block_size, ...]``."""
        return [t for t in (getattr(self, f) for f in self.BLOCK_FIELDS) if t is not None]

    def append(self, first: torch.Tensor, second: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "triton"):
        """Quantize new tokens (MLA: latent, rope; GQA: k, v) in PyTorch and scatter them to their
        slots (kv_append per component)."""
        from .append import kv_append  # imported here: the layouts themselves need no Triton

        for dst, rows in self.quantize_rows(first, second):
            kv_append(dst, rows, slot_mapping, backend=backend)

    def select_blocks(self, block_ids: torch.Tensor):
        """A cache of the same mode holding only blocks ``block_ids`` (copies; scales shared)."""
        ids = block_ids.long()
        picked = {f: getattr(self, f)[ids] for f in self.BLOCK_FIELDS if getattr(self, f) is not None}
        return dataclasses.replace(self, **picked)


# ----------------------------------------------------------------------------------------------
# MLA
# ----------------------------------------------------------------------------------------------


@dataclass
class MLACacheLayer(_PagedLayer):
    """One layer's paged MLA cache (latent + shared RoPE key); layouts in the module docstring."""

    mode: str
    kv_lora_rank: int
    rope_dim: int
    data: torch.Tensor
    rope: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    tensor_scale: torch.Tensor | None = None
    rope_scale: torch.Tensor | None = None  # an e4m3 rope's dequant scale: the exported kv scale (nvfp4)
    frames: dict[str, CacheFrame] | None = None  # ggml: {"kv": frame}

    BLOCK_FIELDS = ("data", "rope", "scales")

    @staticmethod
    def layout(mode: str, num_blocks: int, block_size: int, r: int, p: int, n_tiles: int | None = None,
               frames: dict[str, CacheFrame] | None = None) -> Layout:
        """The block tensors of ``mode`` (``n_tiles``: fp8_tile's scales per row; ``frames``: ggml's)."""
        if mode not in (*MLA_MODES, *EMULATED_MODES):
            raise KVConvertError(f"unknown MLA cache mode {mode!r}: choose one of {(*MLA_MODES, *EMULATED_MODES)}")
        nb_bs = (num_blocks, block_size)
        if mode == "ggml":
            return {"data": ((*nb_bs, (r + p) // GGML_BLOCK, _frame(frames, "kv").block_bytes), (torch.uint8,))}
        if mode in ("none", *SCALED_MODES):
            return {"data": ((*nb_bs, r + p), VALUE_DTYPES[mode])}
        if mode == "fp8_tile":
            return {"data": ((*nb_bs, r), (FP8_DTYPE,)), "scales": ((*nb_bs, n_tiles), (torch.float32,)),
                    "rope": ((*nb_bs, p), PLAIN_DTYPES)}
        return {"data": ((*nb_bs, r // 2), (torch.uint8,)), "scales": ((*nb_bs, r // 16), (FP8_DTYPE,)),
                "rope": ((*nb_bs, p), (*PLAIN_DTYPES, FP8_DTYPE))}

    def __post_init__(self):
        r, p = self.kv_lora_rank, self.rope_dim
        if r <= 0 or p <= 0:
            raise KVConvertError(f"kv_lora_rank and rope_dim must be positive, got {r} and {p}")
        if self.data.dim() != (4 if self.mode == "ggml" else 3):
            raise KVConvertError(f"MLA cache data must be [num_blocks, block_size, width] (ggml: [..., blocks, bytes]), "
                                 f"got {tuple(self.data.shape)}")
        if self.mode == "nvfp4" and r % 16:
            raise KVConvertError(f"NVFP4 needs kv_lora_rank to be a multiple of 16, got {r}")
        if self.mode == "ggml" and (r + p) % GGML_BLOCK:
            raise KVConvertError(f"llama.cpp's cache types need kv_lora_rank + rope ({r + p}) to be a multiple of "
                                 f"{GGML_BLOCK}")
        n_tiles = None
        if self.mode == "fp8_tile":
            n_tiles = 0 if self.scales is None else self.scales.shape[-1]
            if n_tiles == 0 or r % n_tiles or (r // n_tiles) % 16:
                raise KVConvertError(f"MLA fp8 tile scales must split {r} into tiles of a multiple of 16 values")
        self._check_tensors(self.layout(self.mode, *self.data.shape[:2], r, p, n_tiles, self.frames))
        if self.mode in (*SCALED_MODES, "nvfp4"):
            _expect(self.tensor_scale, f"MLA {self.mode} tensor_scale", (1,), (torch.float32,))
        if self.rope_fp8:
            _expect(self.rope_scale, "MLA nvfp4 rope_scale (an e4m3 rope's)", (1,), (torch.float32,))

    @property
    def rope_fp8(self) -> bool:
        """k_rope stored apart in e4m3 (nvfp4 mode), scaled by ``rope_scale``."""
        return self.rope is not None and self.rope.dtype == FP8_DTYPE

    @property
    def fp8_tile(self) -> int:
        return self.kv_lora_rank // self.scales.shape[-1]

    @classmethod
    def allocate(cls, mode: str, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 kv_scale: float | torch.Tensor | None = None, fp8_tile: int | None = None,
                 frames: dict[str, CacheFrame] | None = None) -> "MLACacheLayer":
        """Zeroed cache. ``dtype``: the plain / RoPE dtype (nvfp4: float8_e4m3fn stores k_rope in e4m3 with the
        kv scale). ``kv_scale``: exported amax/448 (fp8, nvfp4). ``frames``: ggml's {"kv": CacheFrame}."""
        r = kv_lora_rank
        tensor_scale, n_tiles = None, None
        if mode in (*SCALED_MODES, "nvfp4"):
            if kv_scale is None:
                raise KVConvertError(f"MLA mode {mode!r} needs a calibrated kv_scale (amax / 448; int8: amax / 127)")
            tensor_scale = _stored_scale(mode, kv_scale, 1, "MLA kv_scale", device)
        if mode == "fp8_tile":
            tile = fp8_tile or mla_fp8_tile(r)
            if r % tile:
                raise KVConvertError(f"fp8 tile {tile} does not divide kv_lora_rank {r}")
            n_tiles = r // tile
        tensors = cls._zeros(cls.layout(mode, num_blocks, block_size, r, rope_dim, n_tiles, frames), dtype, device)
        layer = cls(mode, r, rope_dim, **tensors, tensor_scale=tensor_scale,
                    rope_scale=torch.ones(1, device=device) if dtype == FP8_DTYPE and mode == "nvfp4" else None,
                    frames=frames if mode == "ggml" else None)
        if layer.rope_fp8:
            layer.set_kv_scales(kv_scale)  # the e4m3 rope's scale, from the same exported kv scale
        return layer

    def set_kv_scales(self, kv_scale: float | torch.Tensor) -> None:
        """Replace the fp8 / nvfp4 scale (and an e4m3 rope's) by one from an exported kv scale (amax / 448)."""
        self.tensor_scale = _stored_scale(self.mode, kv_scale, 1, "MLA kv_scale", self.device)
        if self.rope_fp8:
            self.rope_scale = _scale_tensor(kv_scale, 1, "MLA kv_scale", self.device)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """What one token caches, dequantized: ``(R + P,)``."""
        return (self.kv_lora_rank + self.rope_dim,)

    def stored(self, name: str = "kv") -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                                torch.Tensor | None]:
        """(values or codes, block scales, scale, 16-bit RoPE tail) of the cached rows, "kv" (not fp8_tile)."""
        return self.data, self.scales, self.tensor_scale, self.rope

    def quantize_rows(self, latent: torch.Tensor, rope: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cache tensor, rows) pairs for new tokens: latent ``[T, R]``, rope ``[T, P]`` (any float dtype)."""
        if latent.shape[-1] != self.kv_lora_rank or rope.shape[-1] != self.rope_dim or latent.shape[0] != rope.shape[0]:
            raise KVConvertError(
                f"new MLA rows {tuple(latent.shape)} / {tuple(rope.shape)} do not match "
                f"kv_lora_rank {self.kv_lora_rank} / rope_dim {self.rope_dim}"
            )
        if self.mode in ("none", *SCALED_MODES):  # one row [latent | rope]
            row = torch.cat([latent, rope], -1)
            return [(self.data, _quantize(self.mode, row, self.data.dtype, self.tensor_scale)[0])]
        if self.mode == "ggml":  # llama.cpp quantizes the whole row
            return [(self.data, self.frames["kv"].encode(torch.cat([latent.float(), rope.float()], -1)))]
        if self.mode == "fp8_tile":
            latent_rows = F.fp8_tile_quantize(latent, self.fp8_tile)
        else:
            latent_rows = _quantize(self.mode, latent, self.data.dtype, self.tensor_scale)
        rope_rows = F.fp8_quantize(rope, self.rope_scale, FP8_DTYPE) if self.rope_fp8 else rope.to(self.rope.dtype)
        return [*zip((self.data, self.scales), latent_rows), (self.rope, rope_rows)]

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache in fp32: latent ``[nb, bs, R]``, rope ``[nb, bs, P]`` (reference path)."""
        if self.mode in ("none", *SCALED_MODES, "ggml"):
            full = self.read_rows(self.data) if self.mode == "ggml" else dequantize_rows(self.mode, self.data,
                                                                                          self.tensor_scale)
            return full[..., : self.kv_lora_rank], full[..., self.kv_lora_rank:]
        if self.mode == "fp8_tile":
            return F.fp8_tile_dequantize(self.data, self.scales), self.rope.float()
        return dequantize_rows(self.mode, self.data, self.tensor_scale, self.scales), self.dequantize_rope(self.rope)

    def read_rows(self, blocks: torch.Tensor, name: str = "kv", out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ggml: stored blocks (this cache's ``data`` or a gather of it) -> rows [..., R + P] in the model's frame."""
        return self.frames[name].decode(blocks, out_dtype)

    def dequantize_rope(self, rope: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored k_rope rows (this cache's ``rope`` or a gather of it) in out_dtype: e4m3 times rope_scale."""
        if self.rope_fp8:
            return dequantize_rows("fp8", rope, self.rope_scale, out_dtype=out_dtype)
        return rope.to(out_dtype)


# ----------------------------------------------------------------------------------------------
# GQA
# ----------------------------------------------------------------------------------------------


@dataclass
class GQACacheLayer(_PagedLayer):
    """One layer's paged K/V cache; layouts in the module docstring."""

    mode: str
    head_dim: int
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_block_scales: torch.Tensor | None = None
    v_block_scales: torch.Tensor | None = None
    frames: dict[str, CacheFrame] | None = None  # ggml: {"k": frame, "v": frame}

    BLOCK_FIELDS = ("k", "v", "k_block_scales", "v_block_scales")

    @staticmethod
    def layout(mode: str, num_blocks: int, block_size: int, kv_heads: int, d: int,
               frames: dict[str, CacheFrame] | None = None) -> Layout:
        """The block tensors of ``mode``, k and v alike (ggml: each in its frame's type)."""
        if mode not in (*GQA_MODES, *EMULATED_MODES):
            raise KVConvertError(f"unknown GQA cache mode {mode!r}: choose one of {(*GQA_MODES, *EMULATED_MODES)}")
        rows = (num_blocks, block_size, kv_heads)
        if mode == "ggml":
            return {side: ((*rows, d // GGML_BLOCK, _frame(frames, side).block_bytes), (torch.uint8,)) for side in "kv"}
        if mode == "nvfp4":
            codes, block_scales = ((*rows, d // 2), (torch.uint8,)), ((*rows, d // 16), (FP8_DTYPE,))
            return {"k": codes, "v": codes, "k_block_scales": block_scales, "v_block_scales": block_scales}
        values = ((*rows, d), VALUE_DTYPES[mode])
        return {"k": values, "v": values}

    def __post_init__(self):
        if self.k.dim() != (5 if self.mode == "ggml" else 4):
            raise KVConvertError(f"GQA cache must be [num_blocks, block_size, kv_heads, width] (ggml: [..., blocks, "
                                 f"bytes]), got {tuple(self.k.shape)}")
        if self.mode == "nvfp4" and self.head_dim % 16:
            raise KVConvertError(f"NVFP4 needs head_dim to be a multiple of 16, got {self.head_dim}")
        if self.mode == "ggml" and self.head_dim % GGML_BLOCK:
            raise KVConvertError(f"llama.cpp's cache types need head_dim to be a multiple of {GGML_BLOCK}, got "
                                 f"{self.head_dim}")
        h = self.kv_heads
        self._check_tensors(self.layout(self.mode, *self.k.shape[:3], self.head_dim, self.frames))
        for name in ("k_scale", "v_scale") if self.mode not in ("none", "ggml") else ():
            s = getattr(self, name)
            if s is None or s.dtype != torch.float32 or s.dim() != 1 or s.numel() not in (1, h):
                raise KVConvertError(f"{name} must be fp32 [1] or [kv_heads={h}] for mode {self.mode!r}")

    @property
    def kv_heads(self) -> int:
        return self.k.shape[2]

    @classmethod
    def allocate(cls, mode: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
                 frames: dict[str, CacheFrame] | None = None) -> "GQACacheLayer":
        """Zeroed cache; k_scale / v_scale: exported amax/448, a float or per-head ``[kv_heads]``; frames: ggml's
        {"k", "v"} (kvconvert.ggml_formats.llamacpp_frames)."""
        layout = cls.layout(mode, num_blocks, block_size, kv_heads, head_dim, frames)  # rejects an unknown mode first
        scales = {}
        if mode == "ggml":
            scales["frames"] = frames
        elif mode != "none":
            if k_scale is None or v_scale is None:
                raise KVConvertError(f"GQA mode {mode!r} needs calibrated k_scale and v_scale (amax / 448)")
            for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
                scales[name] = _stored_scale(mode, scale, kv_heads, name, device)
        return cls(mode, head_dim, **cls._zeros(layout, dtype, device), **scales)

    def set_kv_scales(self, k_scale: float | torch.Tensor, v_scale: float | torch.Tensor) -> None:
        """Replace the fp8 / nvfp4 scales by ones from exported kv scales (amax / 448, per tensor or head)."""
        self.k_scale = _stored_scale(self.mode, k_scale, self.kv_heads, "k_scale", self.device)
        self.v_scale = _stored_scale(self.mode, v_scale, self.kv_heads, "v_scale", self.device)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """What one token caches in k (and in v), dequantized: ``(kv_heads, head_dim)``."""
        return (self.kv_heads, self.head_dim)

    def stored(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, None]:
        """(values or codes, block scales, scale as [1 or H, 1]: broadcasts over [..., H, D], no RoPE
        tail) of ``name``, "k" or "v"."""
        scale = getattr(self, f"{name}_scale")
        head_scale = None if scale is None else scale.reshape(-1, 1)
        return getattr(self, name), getattr(self, f"{name}_block_scales"), head_scale, None

    def quantize_rows(self, k: torch.Tensor, v: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cache tensor, rows) pairs for new tokens: k, v ``[T, kv_heads, head_dim]``."""
        want = (self.kv_heads, self.head_dim)
        if tuple(k.shape[1:]) != want or tuple(v.shape[1:]) != want or k.shape[0] != v.shape[0]:
            raise KVConvertError(f"new K/V rows {tuple(k.shape)} / {tuple(v.shape)} do not match [T, {want[0]}, {want[1]}]")
        if self.mode == "ggml":
            return [(self.k, self.frames["k"].encode(k)), (self.v, self.frames["v"].encode(v))]
        pairs = []
        for (values, block_scales, scale, _), x in zip(map(self.stored, "kv"), (k, v)):
            pairs += zip((values, block_scales), _quantize(self.mode, x, values.dtype, scale))
        return pairs

    def read_rows(self, blocks: torch.Tensor, name: str, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ggml: stored blocks of ``name`` ("k" / "v"; the cache's or a gather of them) -> [..., H, D], model frame."""
        return self.frames[name].decode(blocks, out_dtype)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache in fp32: k, v ``[nb, bs, kv_heads, head_dim]`` (reference path)."""
        if self.mode == "ggml":
            return self.read_rows(self.k, "k"), self.read_rows(self.v, "v")
        return tuple(dequantize_rows(self.mode, values, scale, block_scales)
                     for values, block_scales, scale, _ in map(self.stored, "kv"))
