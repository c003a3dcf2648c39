"""llama.cpp's (ggml's) block formats for the KV cache, as bit-exact pure-PyTorch references.

A floor module (it imports only errors): kvconvert's runtime stores a llama.cpp-format cache through
it, calibration scores candidates with it, and tests compare it byte for byte with the engine.

What llama.cpp's CPU backend does when it writes a K or V row into a quantized cache (ggml-cpu's
``set_rows`` calls the type's ``from_float`` on each row of K/V values, fp32):

* Blocks of 32 consecutive values along the row (a row is one token's ``kv_heads x head_dim`` values,
  heads contiguous, so a block never straddles two heads when head_dim is a multiple of 32).
* Every block carries an fp16 scale ``d`` (and, for the ``_1`` types, an fp16 minimum ``m``); the codes
  are computed with the fp32 ``d`` and stored beside ``fp16(d)``; reading gives ``code_value * fp16(d)``
  (``+ fp16(m)``), each an exact product in fp32.
* ``q4_0`` (4.5 bits): ``d = max / -8`` where ``max`` is the signed value of largest magnitude (the first
  one on ties), ``code = min(15, trunc(x / d + 8.5))``, value ``(code - 8) d``: the largest-magnitude value
  is exact and the other end of the range clips at ``-7/8`` of it.
* ``q4_1`` (5 bits): ``d = (max - min) / 15``, ``code = min(15, trunc((x - min) / d + 0.5))``, value
  ``code d + m``.
* ``q5_0`` (5.5 bits), ``q5_1`` (6 bits): as q4_0 / q4_1 with 32 / 31 levels (the 5th bits packed apart).
* ``q8_0`` (8.5 bits): the CPU's AVX path (x86_64, the build this project runs): ``d = amax / 127``,
  ``code = round_half_even(x * (127 / amax))``. (ggml's portable reference instead multiplies by ``1/d``
  and rounds half away from zero; the two differ on rare ties and last-bit cases.)
* ``iq4_nl`` (4.5 bits): 16 non-uniform levels ``IQ4_NL_VALUES``; the KV path (``quantize_row_iq4_nl_ref``,
  no trial scales) picks each value's nearest level at ``d0 = max / -127``, then refits
  ``d = sum(w q x) / sum(w q^2)`` with ``w = x^2`` and stores ``fp16(d)`` with the first pass's codes.

Byte layout (``ggml_quantize`` returns ``uint8 [..., n_blocks, block_bytes]``, the engine's blocks as
stored): ``d`` (and ``m``) little-endian fp16 first, then for the 4-bit codes 16 bytes whose low nibble
is element j and high nibble element j + 16 (``q5_*``: a 4-byte mask of the 5th bits before them,
bit j for element j); ``q8_0``: 32 int8 codes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import GGML_BLOCK

IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class GGMLType:
    name: str
    block_bytes: int  # bytes of one block of 32 values
    has_min: bool  # an fp16 minimum after the fp16 scale (q4_1, q5_1)
    code_bits: int  # 4, 5 or 8

    @property
    def bits_per_value(self) -> float:
        return 8 * self.block_bytes / GGML_BLOCK


GGML_TYPES = {t.name: t for t in (
    GGMLType("q8_0", 34, False, 8),
    GGMLType("q4_0", 18, False, 4),
    GGMLType("q4_1", 20, True, 4),
    GGMLType("q5_0", 22, False, 5),
    GGMLType("q5_1", 24, True, 5),
    GGMLType("iq4_nl", 18, False, 4),
)}


def ggml_type(name: str) -> GGMLType:
    try:
        return GGML_TYPES[name]
    except KeyError:
        raise KVConvertError(f"unknown llama.cpp cache type {name!r}: use one of {', '.join(GGML_TYPES)}") from None


# ----------------------------------------------------------------------------------------------
# quantize: float [..., D] -> (codes uint8 [..., D/32, 32] as integers, d fp16 [..., D/32], m fp16 or None)
# ----------------------------------------------------------------------------------------------


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % GGML_BLOCK:
        raise KVConvertError(f"llama.cpp's block formats need rows that are a multiple of {GGML_BLOCK} values, got "
                             f"{x.shape[-1]}")
    if x.is_floating_point() and bool(torch.isnan(x).any()):
        raise KVConvertError("a K/V row contains NaN: fix the producer of this tensor before quantizing")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // GGML_BLOCK, GGML_BLOCK)


def _signed_max(b: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude per block, keeping its sign; the first one on ties (ggml's strict <)."""
    return b.gather(-1, b.abs().argmax(-1, keepdim=True))  # torch's argmax returns the first maximum


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


def _trunc_codes(y: torch.Tensor, top: int) -> torch.Tensor:
    """ggml's ``MIN(top, (int8_t)(y))`` for y >= 0 (always the case here up to fp32 rounding)."""
    return torch.trunc(y).clamp(0, top)


def _symmetric(b: torch.Tensor, levels: int):
    """q4_0 (levels 16) / q5_0 (32): d = max / -(levels/2), code = min(levels-1, trunc(x/d + levels/2 + 0.5))."""
    half = levels // 2
    mx = _signed_max(b)
    d = mx / -half
    codes = _trunc_codes(b * _reciprocal(d) + (half + 0.5), levels - 1)
    return codes, d, None


def _affine(b: torch.Tensor, levels: int):
    """q4_1 (16) / q5_1 (32): d = (max - min) / (levels - 1), code = trunc((x - min)/d + 0.5)."""
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / (levels - 1)
    codes = _trunc_codes((b - lo) * _reciprocal(d) + 0.5, levels - 1)
    return codes, d, lo


def _q8_0(b: torch.Tensor):
    amax = b.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax != 0, 127.0 / torch.where(amax != 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    return torch.round(b * inv), d, None  # torch.round: half to even, as _mm256_round_ps(_MM_ROUND_NEAREST)


def _nearest_level(y: torch.Tensor) -> torch.Tensor:
    """ggml's best_index_int8 over IQ4_NL_VALUES: the nearest level, the upper one unless the lower is strictly
    nearer (its fp32 test ``y - lower < upper - y``). One bucketize against the midpoints gives the same index:
    the test can only disagree with ``y < (lower + upper) / 2`` where the two differences round, and within a few
    ulps of any midpoint they are exact (the midpoints' magnitudes are >= 4.5, so y's ulp there is >= 2^-21, and
    half the gap between neighbouring levels is <= 12: each difference is a multiple of y's ulp below 2^24 of
    them). The level index is then the number of midpoints <= y (tests/test_ggml_formats.py checks it against the
    two-difference form around every midpoint)."""
    return torch.bucketize(y.contiguous(), _iq4_nl_midpoints(str(y.device)), right=True)


@functools.lru_cache(maxsize=4)
def _iq4_nl_midpoints(device: str) -> torch.Tensor:
    """[15] fp32: (level i + level i + 1) / 2 of IQ4_NL_VALUES (exact: half-integers)."""
    v = IQ4_NL_VALUES
    return torch.tensor([(a + b) / 2 for a, b in zip(v, v[1:])], dtype=torch.float32, device=device)


def _iq4_nl(b: torch.Tensor):
    levels = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=b.device)
    mx = _signed_max(b)
    tiny = mx.abs() < 1e-15  # GROUP_MAX_EPS: the block is stored with scale 0
    d0 = mx / float(IQ4_NL_VALUES[0])
    codes = _nearest_level(b * (1.0 / torch.where(tiny, torch.ones_like(d0), d0)))
    q = levels[codes]
    w = b * b
    sumqx, sumq2 = (w * q * b).sum(-1, keepdim=True), (w * q * q).sum(-1, keepdim=True)
    d = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2)), torch.zeros_like(sumq2))
    d = torch.where(tiny, torch.zeros_like(d), d)
    return codes.float(), d, None


_QUANTIZERS = {
    "q8_0": _q8_0,
    "q4_0": lambda b: _symmetric(b, 16),
    "q5_0": lambda b: _symmetric(b, 32),
    "q4_1": lambda b: _affine(b, 16),
    "q5_1": lambda b: _affine(b, 32),
    "iq4_nl": _iq4_nl,
}


def ggml_codes(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize rows x [..., D] as llama.cpp's CPU backend writes its cache (module docstring).

    Returns (codes int16 [..., D/32, 32]: unsigned level indices, signed for q8_0; d fp16 [..., D/32];
    m fp16 [..., D/32] for q4_1 / q5_1, else None)."""
    ggml_type(name)
    codes, d, m = _QUANTIZERS[name](_blocks(x))
    return codes.to(torch.int16), d[..., 0].to(torch.float16), None if m is None else m[..., 0].to(torch.float16)


def ggml_values(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, name: str,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Read back: codes [..., n, 32], d / m [..., n] -> values [..., n * 32] (ggml's dequantize_row_*)."""
    t = ggml_type(name)
    c = codes.float()
    if name == "iq4_nl":
        c = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]
    elif not t.has_min and t.code_bits < 8:
        c = c - 2 ** (t.code_bits - 1)  # q4_0: code - 8, q5_0: code - 16
    out = c * d.float()[..., None]
    if m is not None:
        out = out + m.float()[..., None]
    return out.reshape(*out.shape[:-2], -1).to(out_dtype)


def ggml_fake_quant(x: torch.Tensor, name: str) -> torch.Tensor:
    """Quantize-dequantize rows x [..., D] (D a multiple of 32) as llama.cpp stores and reads them; x's dtype."""
    return ggml_values(*ggml_codes(x, name), name).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# bytes: the engine's blocks as stored
# ----------------------------------------------------------------------------------------------


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.contiguous().view(torch.uint8).reshape(*v.shape, 2)  # little-endian on every platform torch runs


def ggml_quantize(x: torch.Tensor, name: str) -> torch.Tensor:
    """Rows x [..., D] -> uint8 [..., D/32, block_bytes]: the exact bytes llama.cpp's cache holds."""
    t = ggml_type(name)
    codes, d, m = ggml_codes(x, name)
    head = [_fp16_bytes(d)] + ([_fp16_bytes(m)] if m is not None else [])
    if t.code_bits == 8:
        body = [codes.to(torch.int8).view(torch.uint8)]
    else:
        c = codes.to(torch.int32)
        low = c & 0xF
        nibbles = (low[..., :16] | (low[..., 16:] << 4)).to(torch.uint8)
        body = [nibbles]
        if t.code_bits == 5:  # bit j of the little-endian qh word = 5th bit of element j: byte i holds 8i..8i+7
            high = ((c >> 4) & 1).reshape(*c.shape[:-1], 4, 8) << torch.arange(8, dtype=torch.int32, device=c.device)
            body = [high.sum(-1).to(torch.uint8), nibbles]
    return torch.cat(head + body, -1)


def ggml_dequantize(blocks: torch.Tensor, name: str, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., n, block_bytes] (ggml_quantize's) -> values [..., n * 32]: ggml_values of the codes the bytes
    hold, bit for bit (tests/test_ggml_formats.py), read through per-byte tables (a runtime reads its whole cache
    every step: the codes are never unpacked one field at a time)."""
    t = ggml_type(name)
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != t.block_bytes:
        raise KVConvertError(f"{name} blocks must be uint8 [..., {t.block_bytes}], got {blocks.dtype} "
                             f"{tuple(blocks.shape)}")
    b = blocks.contiguous()
    d = b[..., 0:2].view(torch.float16).float()  # [..., n, 1]
    m = b[..., 2:4].view(torch.float16).float() if t.has_min else None
    body = b[..., 4 if t.has_min else 2:]
    if t.code_bits == 8:
        values = body.view(torch.int8).float()
    else:
        if t.code_bits == 5:
            qh, body = body[..., :4], body[..., 4:]
        # byte j of the body holds element j (low nibble) and element j + 16 (high nibble)
        values = _nibble_values(name, str(b.device))[body.long()].transpose(-1, -2).reshape(*body.shape[:-1], 32)
        if t.code_bits == 5:  # bit j of the little-endian qh word is element j's fifth bit, worth 16
            values = values + _bit_values(str(b.device))[qh.long()].reshape(*qh.shape[:-1], 32)
    out = values * d
    if m is not None:
        out = out + m
    return out.reshape(*out.shape[:-2], -1).to(out_dtype)


@functools.lru_cache(maxsize=16)
def _nibble_values(name: str, device: str) -> torch.Tensor:
    """[256, 2] fp32: the values (before the block scale) of a byte's low and high nibble: iq4_nl's levels, q4_0's
    code - 8, q5_0's code - 16 before its fifth bit, q4_1 / q5_1's code (their minimum added after the scale)."""
    nibbles = torch.stack([torch.arange(256) & 0xF, torch.arange(256) >> 4], -1)
    if name == "iq4_nl":
        return torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)[nibbles].to(device)
    t = ggml_type(name)
    offset = 0 if t.has_min else 2 ** (t.code_bits - 1)
    return (nibbles - offset).float().to(device)


@functools.lru_cache(maxsize=4)
def _bit_values(device: str) -> torch.Tensor:
    """[256, 8] fp32: 16 x bit b of a byte (q5_0 / q5_1's fifth bits)."""
    return (((torch.arange(256)[:, None] >> torch.arange(8)) & 1) * 16).float().to(device)


# ----------------------------------------------------------------------------------------------
# llama.cpp's cache frame: what it does to K and V rows before it quantizes them
# ----------------------------------------------------------------------------------------------
# Read in the llama.cpp that kvconvert builds and tests (llama-cpp-python 0.3.36's vendor/llama.cpp,
# src/llama-kv-cache.cpp and src/llama-graph.cpp):
# * Per-head K/V (LLAMA and the like): with a quantized K cache and head_dim % 64 == 0, q and k are
#   multiplied by a normalized Walsh-Hadamard matrix over consecutive groups of n values of each head, n the
#   largest power of two >= 64 dividing head_dim; with a quantized V cache (head_dim % 64 == 0), v by the
#   64 x 64 one, and the attention output by it again (H = H^T = H^-1). LLAMA_ATTN_ROT_DISABLE=1 turns both
#   off. So the cache holds Q(H k) and scores read (H q) . deq(Q(H k)) = q . H deq(Q(H k)).
# * Its LLAMA graph uses interleaved RoPE pairs (2i, 2i+1): its GGUF converter permutes q_proj / k_proj rows
#   from Hugging Face's rotate-half order (i, i + head_dim/2), so a cached K row holds the channels of each
#   head in that order, which decides what shares a block of 32 and a Hadamard group.
# * MLA (DEEPSEEK2 with the absorbed path): the row [latent | k_rope] is cached whole in the K type, the
#   latent read back as V from the same row; that path applies no rotation.
# (On the CPU the engine also rounds q to q8_0 for its dot products with a quantized K; an error of the size
# of a q8_0 cache's, about 1e-4 nats of KL on SmolLM2, not emulated.)

ROTATION_ENV = "LLAMA_ATTN_ROT_DISABLE"  # llama.cpp's own switch, honoured by the emulation too


def c_atoi(text: str) -> int:
    """C's atoi as glibc has it ((int) strtol(text, NULL, 10)): leading white space, an optional sign, then the
    longest run of digits ("1.5" -> 1, "1abc" -> 1, "abc" -> 0, "-1" -> -1); an overflow clamps to a long's range,
    then the int keeps the low 32 bits."""
    import re

    found = re.match(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)", text)
    if not found:
        return 0
    value = int(found.group(2)) * (-1 if found.group(1) == "-" else 1)
    value = max(-2**63, min(2**63 - 1, value)) & 0xFFFFFFFF
    return value - 2**32 if value >= 2**31 else value


def rotation_enabled() -> bool:
    """llama.cpp's switch as llama.cpp reads it (src/llama-kv-cache.cpp: atoi(getenv(LLAMA_ATTN_ROT_DISABLE)), off
    when that is not 0): unset, "0", "" or "abc" leave it on; "1", "2", "1.5", "1abc" or "-1" turn it off."""
    import os

    return c_atoi(os.environ.get(ROTATION_ENV) or "") == 0


@functools.lru_cache(maxsize=8)
def hadamard_matrix(n: int) -> torch.Tensor:
    """(Cached; do not modify it.) ggml_gen_hadamard's normalized Sylvester matrix [n, n] (n a power of two), fp32 entries +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise KVConvertError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / n ** 0.5).float()


def key_rotation_size(head_dim: int) -> int:
    """llama.cpp's K rotation group: the largest power of two >= 64 dividing head_dim."""
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def rope_halves_to_pairs(head_dim: int) -> torch.Tensor:
    """Channel order of llama.cpp's K head from Hugging Face's: llama channel 2i holds HF channel i, 2i + 1 holds
    i + head_dim/2 (its converter's permute of q_proj / k_proj)."""
    half = head_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half, head_dim)), -1).reshape(-1)


@dataclass(frozen=True)
class CacheFrame:
    """What one cached quantity goes through before llama.cpp quantizes it, per head of `head_dim` values:
    a channel order (None: as given) then a block-diagonal Hadamard of `rotation` values (None: none)."""

    ggml_name: str
    head_dim: int
    order: torch.Tensor | None = None
    rotation: int | None = None

    @property
    def block_bytes(self) -> int:
        return ggml_type(self.ggml_name).block_bytes

    def _turn(self, y: torch.Tensor) -> torch.Tensor:
        """y [..., head_dim] times the block-diagonal Hadamard (symmetric and its own inverse)."""
        if not self.rotation:
            return y
        h = hadamard_matrix(self.rotation).to(y.device)
        return (y.reshape(*y.shape[:-1], -1, self.rotation) @ h).reshape(y.shape)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x [..., heads, head_dim] (or [..., width] for one head) in the model's frame -> the engine's
        stored blocks uint8 [..., heads, head_dim / 32, block_bytes] ([..., width / 32, ...] for one head)."""
        y = x.float().reshape(*x.shape[:-1], -1, self.head_dim)
        if self.order is not None:
            y = y[..., self.order.to(y.device)]
        blocks = ggml_quantize(self._turn(y), self.ggml_name)
        return blocks.reshape(*x.shape[:-1], -1, self.block_bytes)

    def decode(self, blocks: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Inverse of :meth:`encode`: what the engine's attention reads, mapped back to the model's frame."""
        y = ggml_dequantize(blocks, self.ggml_name)  # [..., width]
        back = self._back_to_model()
        if back is not None:  # the inverse turn and channel order in one product (a runtime reads every step)
            y = y.reshape(*y.shape[:-1], -1, self.head_dim) @ back.to(y.device)
        return y.reshape(*blocks.shape[:-2], -1).to(out_dtype)

    def _back_to_model(self) -> torch.Tensor | None:
        """[head_dim, head_dim] fp32 map from the engine's frame to the model's: the block-diagonal Hadamard (its
        own inverse), columns in the inverse channel order; None when the frame is the model's. Cached."""
        if self.order is None and not self.rotation:
            return None
        return _frame_inverse(self.head_dim, self.rotation, None if self.order is None else tuple(self.order.tolist()))

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize-dequantize rows x [..., width] (width a multiple of head_dim) as the engine stores and reads
        them, in the model's frame; x's dtype."""
        return self.decode(self.encode(x), torch.float32).reshape(x.shape).to(x.dtype)


@functools.lru_cache(maxsize=32)
def _frame_inverse(head_dim: int, rotation: int | None, order: tuple[int, ...] | None) -> torch.Tensor:
    """CacheFrame._back_to_model's matrix (cached per frame shape; do not modify it)."""
    m = torch.eye(head_dim)
    if rotation:
        m = torch.block_diag(*[hadamard_matrix(rotation)] * (head_dim // rotation))
    if order is not None:
        m = m[:, torch.argsort(torch.tensor(order))]
    return m.contiguous()


def llamacpp_frames(k_type: str, v_type: str, head_dim: int, mla: bool,
                    rotate: bool | None = None) -> dict[str, CacheFrame]:
    """The frames of llama.cpp's cache for a model: {"k", "v"} for per-head K/V (head_dim values a head, Hugging
    Face's rotate-half channel order), {"kv": ...} for an MLA row (head_dim = its width, engine order already).
    `rotate`: None = as the engine decides (rotation_enabled: on unless LLAMA_ATTN_ROT_DISABLE reads as a non-zero
    number)."""
    rotate = rotation_enabled() if rotate is None else rotate
    if mla:
        return {"kv": CacheFrame(ggml_type(k_type).name, head_dim)}
    rot_ok = rotate and head_dim % 64 == 0
    return {"k": CacheFrame(ggml_type(k_type).name, head_dim, rope_halves_to_pairs(head_dim),
                            key_rotation_size(head_dim) if rot_ok else None),
            "v": CacheFrame(ggml_type(v_type).name, head_dim, None, 64 if rot_ok else None)}
