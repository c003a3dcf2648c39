"""In-kernel KV dequantization shared by the decode kernels (``@triton.jit`` helpers).

Every helper loads a ``[BLOCK_N, BLOCK_D]`` tile of cached rows (tokens x features) and returns it
in the dot operand dtype. Together with the scalar scale the kernel applies after its dots, the
values are exactly those of :mod:`kvconvert.number_formats` (the only rounding is the dot dtype's):

* ``MODE_PLAIN``   (0): 16/32-bit values, upcast to fp32 right after the load.
* ``MODE_FP8``     (1): float8 values times one fp32 ``scale`` (per tensor, or the head's own), the
  scale applied by the kernel to the dot results.
* ``MODE_FP8_TILE``(2): float8 values times an fp32 scale per ``AUX_GROUP`` consecutive features,
  read from an aux tensor (FlashMLA-like per-tile scales).
* ``MODE_NVFP4``   (3): packed uint8 (element 2i in the low nibble) decoded to E2M1, times the
  e4m3 block scale of each 16 features (aux tensor), times the fp32 global ``scale`` (applied by
  the kernel to the dot results; ``e2m1 * s_b`` is exact in fp16, so no rounding is added).
  NVFP4 rows are not returned as one tile but as two ``[BLOCK_N, BLOCK_D // 2]`` halves, even and odd features
  (:func:`load_nvfp4_halves`): the packed bytes load contiguously (vectorized) and each nibble
  plane feeds its own dot, so no register shuffle re-interleaves them. The kernels split q and the
  output the same way: ``q . k = q[0::2] . k_even + q[1::2] . k_odd``.

With the launchers' ``word_planes`` option fp8 and NVFP4 rows are read as 16-bit words instead of bytes and
split into their byte planes (:func:`load_fp8_byte_planes`: even/odd features) or nibble planes
(:func:`load_nvfp4_nibble_planes`: features q mod 4), each its own dot operand: a 16-bit tile transposes
with ldmatrix for the P@V dot, an 8-bit one is read back byte by byte on Hopper (docs/BENCHMARKS.md "Kernels").

Per-group scales are expanded to features by a broadcast+reshape when ``AUX_BROADCAST`` (the group
is a power of two that tiles BLOCK_D) and by a gather otherwise (e.g. FP8 tiles of 96 or 80).
"""

from __future__ import annotations

from ._triton_compat import HAS_TRITON, tl, triton

MODE_PLAIN = 0
MODE_FP8 = 1
MODE_FP8_TILE = 2
MODE_NVFP4 = 3
# a cache layout's mode -> the kernels' MODE constexpr
MODE_IDS = {"none": MODE_PLAIN, "fp8": MODE_FP8, "fp8_tile": MODE_FP8_TILE, "nvfp4": MODE_NVFP4}

# Dot operand precision (accumulation is always fp32):
#   fp32: operands stay fp32, IEEE products (reference grade; the CPU/interpreter default)
#   bf16: operands rounded to bf16 for tensor cores (GPU default; bf16 is wrong in the interpreter)
#   fp16: operands rounded to fp16 (exact in the interpreter; range +-65504)
#   fp8:  float8 e4m3 operands, for MODE_FP8 caches only: the cached bytes feed the matrix unit as
#         stored (no conversion), queries are quantized per head row to e4m3 (scale amax / 448,
#         :func:`quantize_rows_e4m3`) and probabilities are stored as e4m3 times P_SCALE_FP8
DOT_PRECISIONS = ("fp32", "bf16", "fp16", "fp8")

if HAS_TRITON:
    # word-planes NVFP4 values carry 2^-14 (e2m1_code_to_f16_tiny): their kernel multiplies its global scale by this
    NVFP4_TINY = tl.constexpr(16384.0)
    # fp8 dots: p in [0, 1] is scaled by 2^8 before its e4m3 rounding: exact (a power of two), keeps
    # the largest value (256) under e4m3's 448 and moves the smallest normal down from 2^-6 to 2^-14
    P_SCALE_FP8 = tl.constexpr(256.0)

    @triton.jit
    def e2m1_code_to_f16(code):
        """int32 codes 0..15 -> exact fp16 E2M1 values, by bit placement rather than arithmetic.

        The magnitude bits (e1 e0 m) go to fp16 bits 11..9 (the exponent's two low bits and the
        mantissa's top bit), the sign to bit 15. That fp16 is the E2M1 value times 2^-14 for every
        code, the E2M1 subnormal (e = 0: 0 or 0.5) landing on an fp16 subnormal, so one exact
        multiply by 2^14 finishes the decode.
        """
        bits = ((code & 8) << 12) | ((code & 7) << 9)
        return (bits.to(tl.uint16).to(tl.float16, bitcast=True) * 16384.0).to(tl.float16)

    @triton.jit
    def load_grid(ptr, row_off, col_off, row_mask, col_mask, other, TRANSPOSED: tl.constexpr):
        """The tile ``ptr[row_off[i] + col_off[j]]`` for rows ``[BLOCK_N]`` x features ``[BLOCK_D]``, laid out
        ``[BLOCK_N, BLOCK_D]``, or its transpose ``[BLOCK_D, BLOCK_N]`` when TRANSPOSED; masked elements read
        ``other`` (0.0 for float data, 0 for packed bytes)."""
        if TRANSPOSED:
            return tl.load(ptr + row_off[None, :] + col_off[:, None], mask=row_mask[None, :] & col_mask[:, None],
                           other=other)
        else:
            return tl.load(ptr + row_off[:, None] + col_off[None, :], mask=row_mask[:, None] & col_mask[None, :],
                           other=other)

    @triton.jit
    def load_group_scales(
        aux_ptr, aux_row_off, offs_d, row_mask, D,
        AUX_GROUP: tl.constexpr, AUX_BROADCAST: tl.constexpr, S_DTYPE: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSED: tl.constexpr,
    ):
        """``[BLOCK_N, BLOCK_D]`` (TRANSPOSED: ``[BLOCK_D, BLOCK_N]``) in S_DTYPE: the scale of each
        feature's group, from aux rows at aux_row_off."""
        n_groups = D // AUX_GROUP
        if AUX_BROADCAST:
            N_AUX: tl.constexpr = BLOCK_D // AUX_GROUP
            offs_a = tl.arange(0, N_AUX)
            s = load_grid(aux_ptr, aux_row_off, offs_a, row_mask, offs_a < n_groups, 0.0, TRANSPOSED)
            s = s.to(tl.float32).to(S_DTYPE)  # convert the small [BLOCK_N, N_AUX] tile, then expand
            if TRANSPOSED:
                s = tl.broadcast_to(s[:, None, :], (N_AUX, AUX_GROUP, BLOCK_N))
                return tl.reshape(s, (BLOCK_D, BLOCK_N))
            else:
                s = tl.broadcast_to(s[:, :, None], (BLOCK_N, N_AUX, AUX_GROUP))
                return tl.reshape(s, (BLOCK_N, BLOCK_D))
        else:
            s = load_grid(aux_ptr, aux_row_off, offs_d // AUX_GROUP, row_mask, offs_d < D, 0.0, TRANSPOSED)
            return s.to(tl.float32).to(S_DTYPE)

    @triton.jit
    def load_kv_tile(
        data_ptr, row_off, row_mask, D, aux_ptr, aux_row_off,
        MODE: tl.constexpr, AUX_GROUP: tl.constexpr, AUX_BROADCAST: tl.constexpr, OUT_DTYPE: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSED: tl.constexpr,
    ):
        """Tile ``[BLOCK_N, BLOCK_D]`` in OUT_DTYPE (the dot operand dtype) of rows at ``data_ptr + row_off``.

        row_off / aux_row_off: int64 ``[BLOCK_N]`` element offsets of each row in the data / aux
        tensor (features contiguous). Masked rows and features beyond D read as 0.

        TRANSPOSED: the tile's transpose ``[BLOCK_D, BLOCK_N]``, read from memory in that layout (features
        down, tokens across) rather than transposed in registers. A kernel that also loads the same rows
        untransposed gives each of its two dots (QK^T, P@V) its own operand layout from global memory;
        for fp8 and nvfp4 tiles on Hopper both loads then compile to cp.async (docs/BENCHMARKS.md).

        MODE_FP8 tiles are the raw float8 values, exact in bf16/fp16/fp32: the per-tensor or per-head
        scale is a scalar per program, so the kernel applies it to the fp32 dot results instead of
        to every element (one multiply per score / output instead of one per cached value).
        MODE_FP8_TILE tiles are fully dequantized (fp32 product, one rounding to OUT_DTYPE).
        """
        tl.static_assert(MODE != 3, "NVFP4 rows load as even/odd halves: use load_nvfp4_halves")
        offs_d = tl.arange(0, BLOCK_D)
        # through fp32 even for float8 -> bf16: a direct conversion measured the same on an H100
        x = load_grid(data_ptr, row_off, offs_d, row_mask, offs_d < D, 0.0, TRANSPOSED)
        if OUT_DTYPE == tl.float8e4nv:  # fp8 dots: the cached e4m3 bytes are the operand, unconverted
            tl.static_assert(MODE == 1, "fp8 dot operands need an fp8 (per-tensor / per-head scale) cache")
        else:
            x = x.to(tl.float32)
            if MODE == 2:
                x = x * load_group_scales(
                    aux_ptr, aux_row_off, offs_d, row_mask, D, AUX_GROUP, AUX_BROADCAST, tl.float32, BLOCK_N, BLOCK_D,
                    TRANSPOSED,
                )
            x = x.to(OUT_DTYPE)
        return x

    @triton.jit
    def load_nvfp4_halves(
        data_ptr, row_off, row_mask, D, aux_ptr, aux_row_off,
        AUX_BROADCAST: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        TRANSPOSED: tl.constexpr,
    ):
        """NVFP4 rows as two tiles ``[BLOCK_N, BLOCK_D // 2]`` in OUT_DTYPE: features 0, 2, 4, ... and 1, 3, 5, ...
        (TRANSPOSED: ``[BLOCK_D // 2, BLOCK_N]`` each, as in :func:`load_kv_tile`).

        Values are ``e2m1 * block_scale`` without the fp32 global scale (a scalar per program that
        the kernel applies to the dot results). That product is exact in fp16 and so in every dot
        dtype: a 2-bit by 4-bit significand, magnitude between 2^-10 and 6 * 448 = 2688.

        Byte j of a row holds features 2j (low nibble) and 2j+1 (high nibble), and both lie in
        block-scale group 2j // 16 = j // 8: the halves share one scale tile with groups of 8.
        (An earlier version re-interleaved the nibbles with tl.interleave; on an H100 with Triton
        3.6 that tile was mis-laid-out as the B operand of a bf16 dot: P@V rel. error ~1.6.)
        """
        HALF: tl.constexpr = BLOCK_D // 2
        offs_j = tl.arange(0, HALF)
        packed = load_grid(data_ptr, row_off, offs_j, row_mask, offs_j < D // 2, 0, TRANSPOSED).to(tl.int32)
        s = load_group_scales(aux_ptr, aux_row_off, offs_j, row_mask, D // 2, 8, AUX_BROADCAST, tl.float16, BLOCK_N, HALF,
                              TRANSPOSED)
        even = (e2m1_code_to_f16(packed & 15) * s).to(OUT_DTYPE)
        odd = (e2m1_code_to_f16(packed >> 4) * s).to(OUT_DTYPE)
        return even, odd


    @triton.jit
    def load_fp8_byte_planes(
        words_ptr, row_off, row_mask, D, OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """MODE_FP8 rows read as 16-bit words (two e4m3 codes each: feature 2j in the low byte, 2j+1 in the
        high byte) -> two tiles ``[BLOCK_N, BLOCK_D // 2]`` in OUT_DTYPE, features 0, 2, 4, ... and 1, 3, 5, ...
        (the raw e4m3 values, exact in every dot dtype; the kernel applies the scalar scale to its dots).

        Why (the sm_90 compile of the MLA fp8 tile read as bytes): the P@V operand is the tile
        transposed (its K is the token axis), and an 8-bit tile has no transposing shared-memory load on Hopper
        (ldmatrix.trans is 16-bit only), so the compiler staged the bytes through registers (synchronous
        ld.global, no cp.async) and read them back one byte at a time (128 ld.shared.b8 + 64 shl/or per tile
        and thread). 16-bit words transpose like a bf16 tile; each byte plane then feeds its own dot, as
        NVFP4's nibble halves do (``load_nvfp4_halves``), so nothing re-interleaves.
        row_off: int64 ``[BLOCK_N]`` offsets of each row in words (the fp8 tensor viewed as int16)."""
        HALF: tl.constexpr = BLOCK_D // 2
        offs_j = tl.arange(0, HALF)
        w = load_grid(words_ptr, row_off, offs_j, row_mask, offs_j < D // 2, 0, False).to(tl.int32)
        even = (w & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(OUT_DTYPE)
        odd = ((w >> 8) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(OUT_DTYPE)
        return even, odd

    @triton.jit
    def load_nvfp4_nibble_planes(
        words_ptr, row_off, row_mask, D, aux_ptr, aux_row_off,
        AUX_BROADCAST: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """NVFP4 rows read as 16-bit words (four E2M1 codes each: features 4j .. 4j+3, from the low nibble up)
        -> four tiles ``[BLOCK_N, BLOCK_D // 4]`` in OUT_DTYPE, features q, q + 4, q + 8, ... for q = 0..3, each
        ``e2m1 * block_scale * 2^-14`` (:func:`e2m1_code_to_f16_tiny`; the kernel's global scale takes the 2^14),
        without the global scale, as :func:`load_nvfp4_halves`. Feature 4j + q lies in
        block-scale group j // 4, so the four planes share one scale tile with groups of 4 words.

        Why: :func:`load_nvfp4_halves` reads the packed bytes as 8-bit elements, whose transpose
        for the P@V operand Hopper can only read from shared memory byte by byte (as an fp8 tile's,
        :func:`load_fp8_byte_planes`); 16-bit words transpose with ldmatrix."""
        QUARTER: tl.constexpr = BLOCK_D // 4
        offs_j = tl.arange(0, QUARTER)
        w = load_grid(words_ptr, row_off, offs_j, row_mask, offs_j < D // 4, 0, False).to(tl.int32)
        s = load_group_scales(aux_ptr, aux_row_off, offs_j, row_mask, D // 4, 4, AUX_BROADCAST, tl.float16, BLOCK_N,
                              QUARTER, False)
        c0 = (e2m1_code_to_f16_tiny(w) * s).to(OUT_DTYPE)
        c1 = (e2m1_code_to_f16_tiny(w >> 4) * s).to(OUT_DTYPE)
        c2 = (e2m1_code_to_f16_tiny(w >> 8) * s).to(OUT_DTYPE)
        c3 = (e2m1_code_to_f16_tiny(w >> 12) * s).to(OUT_DTYPE)
        return c0, c1, c2, c3

    @triton.jit
    def e2m1_code_to_f16_tiny(code):
        """The low 4 bits of int32 ``code`` -> the E2M1 value times 2^-14 in fp16, exactly: the bit placement of
        :func:`e2m1_code_to_f16` without its multiply by 2^14, which the caller folds into its global scale
        (NVFP4_TINY). Times an e4m3 block scale the product stays exact in fp16: its lowest bit is at least
        2^-1 (E2M1) * 2^-9 (e4m3) * 2^-14 = 2^-24, fp16's smallest subnormal, and it is at most
        6 * 448 * 2^-14 < 0.17. One multiply per value instead of two."""
        bits = ((code & 8) << 12) | ((code & 7) << 9)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True)

    @triton.jit
    def round_to_e4m3(x):
        """fp32 x (|x| <= 448) -> fp32 on the e4m3 grid, rounded to nearest even, so the cast that follows
        is exact: bit-identical to torch's ``x.to(float8_e4m3fn)`` compiled and in the interpreter
        (whose own fp32 -> e4m3 cast mis-rounds values that round up into the next binade: 127.9 -> 64).

        Normals (|x| >= 2^-6) keep 3 of fp32's 23 mantissa bits: add half an e4m3 ulp minus one,
        plus the kept lsb (ties to even), then clear the 20 dropped bits. Subnormals are multiples of
        2^-9: adding and removing 1.5 * 2^14 rounds |x| there (fp32's ulp at 2^14 is 2^-9), and x's
        sign bit goes back on (so -tiny -> -0, as in torch).
        """
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        magnitude = ((tl.abs(x) + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
        subnormal = (magnitude | (bits & -2147483648)).to(tl.float32, bitcast=True)
        return tl.where(tl.abs(x) < 0.015625, subnormal, normal)

    @triton.jit
    def quantize_rows_e4m3(x):
        """fp32 ``[BLOCK_H, BLOCK]`` -> (e4m3 ``[BLOCK_H, BLOCK]``, fp32 scale ``[BLOCK_H]``), x ~= q * scale.

        One scale per row (head), amax / 448, so each row's largest magnitude maps to e4m3's largest
        finite value; an all-zero row gets scale 1. The rounding is e4m3's, to nearest even (3 mantissa
        bits: a relative error up to 2^-4 per element).
        """
        # div_rn: compiled Triton lowers fp32 `/` to an approximate division (within 2 ulp), which
        # broke bit-exactness against formats.fp8_tile_quantize on an H100; IEEE division matches it
        amax = tl.max(tl.abs(x), 1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        return round_to_e4m3(tl.math.div_rn(x, scale[:, None])).to(tl.float8e4nv), scale

    @triton.jit
    def probs_operand(p, DOT_DTYPE: tl.constexpr):
        """Probabilities ``[BLOCK_H, BLOCK_N]`` in [0, 1] as the P@V dot operand (fp8: times P_SCALE_FP8,
        which the kernel divides out of its output once)."""
        if DOT_DTYPE == tl.float8e4nv:
            p = round_to_e4m3(p * P_SCALE_FP8)
        return p.to(DOT_DTYPE)


def aux_broadcastable(group: int, block_d: int) -> bool:
    """Whether per-group scales can be expanded by broadcast+reshape (group a power of two <= BLOCK_D)."""
    return group > 0 and (group & (group - 1)) == 0 and group <= block_d


def dot_constexprs(dot: str) -> dict:
    """Kernel constexprs DOT_DTYPE / DOT_PRECISION for a dot precision name (needs Triton)."""
    dtype = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16, "fp8": tl.float8e4nv}[dot]
    # input_precision only matters for fp32 operands ("ieee": no TF32 rounding)
    return {"DOT_DTYPE": dtype, "DOT_PRECISION": "ieee" if dot == "fp32" else "tf32"}
