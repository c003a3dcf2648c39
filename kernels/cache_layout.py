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
                                                                   ``rope`` 16/32-bit ``[nb, bs, P]``
====================  ===========================================  ==============================

* ``fp8`` applies one dequant scale to the whole 576-value row, as vLLM does with ``k_scale``.
* ``fp8_tile`` is FlashMLA's layout: dynamic per-token scales ``amax / 448`` per tile of ``T``
  latent values (T = 128 for DeepSeek's 512), RoPE part kept in 16 bits. ``T`` is the largest
  divisor of R that is a multiple of 16 and at most 128 (R = 64 -> 64, 96 -> 96, 160 -> 80);
  any divisor works in the kernels, which read T from ``scales``' shape.
* ``nvfp4`` quantizes only the latent (blocks of 16, e4m3 block scales, fp32 global scale); the
  RoPE key stays 16-bit like FlashMLA's: it is 11% of the row and carries the position signal
  that 4-bit codes would blur. The global scale is the exported kv scale / 6 (docs/formats.md).

GQA (:class:`GQACacheLayer`), ``k`` and ``v`` alike, ``H = kv_heads``, ``D = head_dim``:

* ``none``: fp32/fp16/bf16 ``[nb, bs, H, D]``.
* ``fp8``: float8_e4m3fn ``[nb, bs, H, D]``; ``k_scale``/``v_scale`` fp32 ``[1]`` (per tensor)
  or ``[H]`` (per head).
* ``nvfp4``: uint8 ``[nb, bs, H, D // 2]``; ``k_block_scales``/``v_block_scales`` e4m3
  ``[nb, bs, H, D // 16]``; ``k_scale``/``v_scale`` = global scale fp32 ``[1]`` or ``[H]``.

Scales passed to ``allocate`` are the exported kv scales (``amax / 448``) for FP8 and NVFP4 alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import KERNEL_MODES
from kvconvert.quant import formats as F

from .append import kv_append

GQA_MODES = KERNEL_MODES  # none, fp8, nvfp4: the registry formats' kernel modes
MLA_MODES = (*KERNEL_MODES, "fp8_tile")  # + FlashMLA's dynamic per-tile layout (no checkpoint format)
FP8_DTYPE = torch.float8_e4m3fn
PLAIN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def _scale_tensor(scale, n: int, what: str, device) -> torch.Tensor:
    """fp32 ``[1]`` or ``[n]`` positive finite scale."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1).clone()
    if s.numel() not in (1, n):
        raise KVConvertError(f"{what} must have 1 or {n} values, got {s.numel()}")
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise KVConvertError(f"{what} must be positive and finite: recalibrate the KV scales")
    return s


# ----------------------------------------------------------------------------------------------
# MLA
# ----------------------------------------------------------------------------------------------


@dataclass
class MLACacheLayer:
    """One layer's paged MLA cache (latent + shared RoPE key); layouts in the module docstring."""

    mode: str
    kv_lora_rank: int
    rope_dim: int
    data: torch.Tensor
    rope: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    tensor_scale: torch.Tensor | None = None

    def __post_init__(self):
        if self.mode not in MLA_MODES:
            raise KVConvertError(f"unknown MLA cache mode {self.mode!r}: choose one of {MLA_MODES}")
        r, p = self.kv_lora_rank, self.rope_dim
        if r <= 0 or p <= 0:
            raise KVConvertError(f"kv_lora_rank and rope_dim must be positive, got {r} and {p}")
        if self.data.dim() != 3:
            raise KVConvertError(f"MLA cache data must be [num_blocks, block_size, width], got {tuple(self.data.shape)}")
        nb, bs = self.data.shape[:2]
        if self.mode == "none":
            _expect(self.data, "MLA cache", (nb, bs, r + p), PLAIN_DTYPES)
        elif self.mode == "fp8":
            _expect(self.data, "MLA fp8 cache", (nb, bs, r + p), (FP8_DTYPE,))
            _expect(self.tensor_scale, "MLA fp8 tensor_scale", (1,), (torch.float32,))
        elif self.mode == "fp8_tile":
            _expect(self.data, "MLA fp8 latent", (nb, bs, r), (FP8_DTYPE,))
            n_tiles = 0 if self.scales is None else self.scales.shape[-1]
            if n_tiles == 0 or r % n_tiles or (r // n_tiles) % 16:
                raise KVConvertError(f"MLA fp8 tile scales must split {r} into tiles of a multiple of 16 values")
            _expect(self.scales, "MLA fp8 tile scales", (nb, bs, n_tiles), (torch.float32,))
            _expect(self.rope, "MLA rope cache", (nb, bs, p), PLAIN_DTYPES)
        else:
            if r % 16:
                raise KVConvertError(f"NVFP4 needs kv_lora_rank to be a multiple of 16, got {r}")
            _expect(self.data, "MLA nvfp4 latent", (nb, bs, r // 2), (torch.uint8,))
            _expect(self.scales, "MLA nvfp4 block scales", (nb, bs, r // 16), (FP8_DTYPE,))
            _expect(self.tensor_scale, "MLA nvfp4 global scale", (1,), (torch.float32,))
            _expect(self.rope, "MLA rope cache", (nb, bs, p), PLAIN_DTYPES)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def block_size(self) -> int:
        return self.data.shape[1]

    @property
    def fp8_tile(self) -> int:
        return self.kv_lora_rank // self.scales.shape[-1]

    @classmethod
    def allocate(
        cls,
        mode: str,
        num_blocks: int,
        block_size: int,
        kv_lora_rank: int,
        rope_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        kv_scale: float | torch.Tensor | None = None,
        fp8_tile: int | None = None,
    ) -> "MLACacheLayer":
        """Zeroed cache. ``dtype``: the plain / RoPE dtype. ``kv_scale``: exported amax/448 (fp8, nvfp4)."""
        shape = (num_blocks, block_size)
        r, p = kv_lora_rank, rope_dim
        if mode in ("fp8", "nvfp4") and kv_scale is None:
            raise KVConvertError(f"MLA mode {mode!r} needs a calibrated kv_scale (amax / 448)")
        if mode == "none":
            return cls(mode, r, p, torch.zeros(*shape, r + p, dtype=dtype, device=device))
        if mode == "fp8":
            scale = _scale_tensor(kv_scale, 1, "MLA kv_scale", device)
            return cls(mode, r, p, torch.zeros(*shape, r + p, dtype=FP8_DTYPE, device=device), tensor_scale=scale)
        rope = torch.zeros(*shape, p, dtype=dtype, device=device)
        if mode == "fp8_tile":
            tile = fp8_tile or mla_fp8_tile(r)
            if r % tile:
                raise KVConvertError(f"fp8 tile {tile} does not divide kv_lora_rank {r}")
            return cls(
                mode, r, p, torch.zeros(*shape, r, dtype=FP8_DTYPE, device=device), rope=rope,
                scales=torch.zeros(*shape, r // tile, dtype=torch.float32, device=device),
            )
        if mode == "nvfp4":
            global_scale = F.nvfp4_global_scale_from_kv_scale(_scale_tensor(kv_scale, 1, "MLA kv_scale", device))
            return cls(
                mode, r, p, torch.zeros(*shape, r // 2, dtype=torch.uint8, device=device), rope=rope,
                scales=torch.zeros(*shape, r // 16, dtype=FP8_DTYPE, device=device), tensor_scale=global_scale,
            )
        raise KVConvertError(f"unknown MLA cache mode {mode!r}: choose one of {MLA_MODES}")

    def quantize_rows(self, latent: torch.Tensor, rope: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cache tensor, rows) pairs for new tokens: latent ``[T, R]``, rope ``[T, P]`` (any float dtype)."""
        if latent.shape[-1] != self.kv_lora_rank or rope.shape[-1] != self.rope_dim or latent.shape[0] != rope.shape[0]:
            raise KVConvertError(
                f"new MLA rows {tuple(latent.shape)} / {tuple(rope.shape)} do not match "
                f"kv_lora_rank {self.kv_lora_rank} / rope_dim {self.rope_dim}"
            )
        if self.mode == "none":
            return [(self.data, torch.cat([latent, rope], -1).to(self.data.dtype))]
        if self.mode == "fp8":
            return [(self.data, F.fp8_quantize(torch.cat([latent, rope], -1), self.tensor_scale))]
        rope_rows = (self.rope, rope.to(self.rope.dtype))
        if self.mode == "fp8_tile":
            q, s = F.fp8_tile_quantize(latent, self.fp8_tile)
            return [(self.data, q), (self.scales, s), rope_rows]
        packed, block_scales = F.nvfp4_quantize(latent, self.tensor_scale)
        return [(self.data, packed), (self.scales, block_scales), rope_rows]

    def append(self, latent: torch.Tensor, rope: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "triton"):
        """Quantize new tokens in PyTorch and scatter them to their slots (kv_append per component)."""
        for dst, rows in self.quantize_rows(latent, rope):
            kv_append(dst, rows, slot_mapping, backend=backend)

    def select_blocks(self, block_ids: torch.Tensor) -> "MLACacheLayer":
        """A cache of the same mode holding only blocks ``block_ids`` (copies; scales shared)."""
        ids = block_ids.long()
        pick = (lambda t: None if t is None else t[ids])
        return MLACacheLayer(
            self.mode, self.kv_lora_rank, self.rope_dim, self.data[ids], pick(self.rope), pick(self.scales),
            self.tensor_scale,
        )

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache in fp32: latent ``[nb, bs, R]``, rope ``[nb, bs, P]`` (reference path)."""
        r = self.kv_lora_rank
        if self.mode == "none":
            full = self.data.float()
        elif self.mode == "fp8":
            full = F.fp8_dequantize(self.data, self.tensor_scale)
        elif self.mode == "fp8_tile":
            return F.fp8_tile_dequantize(self.data, self.scales), self.rope.float()
        else:
            return F.nvfp4_dequantize(self.data, self.scales, self.tensor_scale), self.rope.float()
        return full[..., :r], full[..., r:]


# ----------------------------------------------------------------------------------------------
# GQA
# ----------------------------------------------------------------------------------------------


@dataclass
class GQACacheLayer:
    """One layer's paged K/V cache; layouts in the module docstring."""

    mode: str
    head_dim: int
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_block_scales: torch.Tensor | None = None
    v_block_scales: torch.Tensor | None = None

    def __post_init__(self):
        if self.mode not in GQA_MODES:
            raise KVConvertError(f"unknown GQA cache mode {self.mode!r}: choose one of {GQA_MODES}")
        if self.k.dim() != 4:
            raise KVConvertError(f"GQA cache must be [num_blocks, block_size, kv_heads, width], got {tuple(self.k.shape)}")
        nb, bs, h = self.k.shape[:3]
        d = self.head_dim
        for name, t in (("k", self.k), ("v", self.v)):
            if self.mode == "none":
                _expect(t, f"{name} cache", (nb, bs, h, d), PLAIN_DTYPES)
            elif self.mode == "fp8":
                _expect(t, f"{name} fp8 cache", (nb, bs, h, d), (FP8_DTYPE,))
            else:
                if d % 16:
                    raise KVConvertError(f"NVFP4 needs head_dim to be a multiple of 16, got {d}")
                _expect(t, f"{name} nvfp4 cache", (nb, bs, h, d // 2), (torch.uint8,))
                _expect(getattr(self, f"{name}_block_scales"), f"{name} block scales", (nb, bs, h, d // 16), (FP8_DTYPE,))
            if self.mode != "none":
                s = getattr(self, f"{name}_scale")
                if s is None or s.dtype != torch.float32 or s.dim() != 1 or s.numel() not in (1, h):
                    raise KVConvertError(f"{name}_scale must be fp32 [1] or [kv_heads={h}] for mode {self.mode!r}")

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[2]

    @classmethod
    def allocate(
        cls,
        mode: str,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> "GQACacheLayer":
        """Zeroed cache; k_scale / v_scale: exported amax/448, a float or per-head ``[kv_heads]``."""
        shape = (num_blocks, block_size, kv_heads)
        if mode == "none":
            return cls(mode, head_dim, *(torch.zeros(*shape, head_dim, dtype=dtype, device=device) for _ in "kv"))
        if mode not in GQA_MODES:
            raise KVConvertError(f"unknown GQA cache mode {mode!r}: choose one of {GQA_MODES}")
        if k_scale is None or v_scale is None:
            raise KVConvertError(f"GQA mode {mode!r} needs calibrated k_scale and v_scale (amax / 448)")
        ks = _scale_tensor(k_scale, kv_heads, "k_scale", device)
        vs = _scale_tensor(v_scale, kv_heads, "v_scale", device)
        if mode == "fp8":
            k, v = (torch.zeros(*shape, head_dim, dtype=FP8_DTYPE, device=device) for _ in "kv")
            return cls(mode, head_dim, k, v, ks, vs)
        k, v = (torch.zeros(*shape, head_dim // 2, dtype=torch.uint8, device=device) for _ in "kv")
        kb, vb = (torch.zeros(*shape, head_dim // 16, dtype=FP8_DTYPE, device=device) for _ in "kv")
        g = F.nvfp4_global_scale_from_kv_scale
        return cls(mode, head_dim, k, v, g(ks), g(vs), kb, vb)

    def _head_scale(self, s: torch.Tensor) -> torch.Tensor:
        return s.reshape(-1, 1)  # [1 or H, 1]: broadcasts over [T, H, D]

    def quantize_rows(self, k: torch.Tensor, v: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cache tensor, rows) pairs for new tokens: k, v ``[T, kv_heads, head_dim]``."""
        want = (self.kv_heads, self.head_dim)
        if tuple(k.shape[1:]) != want or tuple(v.shape[1:]) != want or k.shape[0] != v.shape[0]:
            raise KVConvertError(f"new K/V rows {tuple(k.shape)} / {tuple(v.shape)} do not match [T, {want[0]}, {want[1]}]")
        if self.mode == "none":
            return [(self.k, k.to(self.k.dtype)), (self.v, v.to(self.v.dtype))]
        if self.mode == "fp8":
            return [
                (self.k, F.fp8_quantize(k, self._head_scale(self.k_scale))),
                (self.v, F.fp8_quantize(v, self._head_scale(self.v_scale))),
            ]
        kp, kb = F.nvfp4_quantize(k, self._head_scale(self.k_scale))
        vp, vb = F.nvfp4_quantize(v, self._head_scale(self.v_scale))
        return [(self.k, kp), (self.k_block_scales, kb), (self.v, vp), (self.v_block_scales, vb)]

    def append(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "triton"):
        """Quantize new tokens in PyTorch and scatter them to their slots (kv_append per component)."""
        for dst, rows in self.quantize_rows(k, v):
            kv_append(dst, rows, slot_mapping, backend=backend)

    def select_blocks(self, block_ids: torch.Tensor) -> "GQACacheLayer":
        """A cache of the same mode holding only blocks ``block_ids`` (copies; scales shared)."""
        ids = block_ids.long()
        pick = (lambda t: None if t is None else t[ids])
        return GQACacheLayer(
            self.mode, self.head_dim, self.k[ids], self.v[ids], self.k_scale, self.v_scale,
            pick(self.k_block_scales), pick(self.v_block_scales),
        )

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache in fp32: k, v ``[nb, bs, kv_heads, head_dim]`` (reference path)."""
        if self.mode == "none":
            return self.k.float(), self.v.float()
        if self.mode == "fp8":
            return (
                F.fp8_dequantize(self.k, self._head_scale(self.k_scale)),
                F.fp8_dequantize(self.v, self._head_scale(self.v_scale)),
            )
        return (
            F.nvfp4_dequantize(self.k, self.k_block_scales, self._head_scale(self.k_scale)),
            F.nvfp4_dequantize(self.v, self.v_block_scales, self._head_scale(self.v_scale)),
        )
