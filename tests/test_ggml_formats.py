"""kvconvert.ggml_formats against llama.cpp's own quantizers, byte for byte.

Two references: gguf-py's numpy ports of ggml's reference quantizers (q4_0, q4_1, q5_0, q5_1, q8_0; always
here, gguf is a dependency), and the engine itself: ggml-cpu's ``from_float`` of each type, the function
llama.cpp's CPU backend writes its KV cache with, called through ctypes from the libggml-cpu that
llama-cpp-python installs (tests marked llamacpp; scripts/setup_llamacpp.sh).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.ggml_formats import (GGML_TYPES, IQ4_NL_VALUES, _nearest_level, ggml_codes, ggml_dequantize,
                                    ggml_fake_quant, ggml_quantize)

GGUF_PY = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # types gguf-py can quantize
GGML_TYPE_IDS = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20}  # enum ggml_type


def rows(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Rows with per-row magnitudes from 1e-3 to 10, an outlier, an all-zero block, exact ties and halves."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-3, 1, n)[:, None]
    x[0, :32] = 0.0
    x[1, 7] = 50.0  # one outlier
    x[2, :32] = torch.arange(32) * 0.5 - 8  # halves: ties for every rounding rule
    x[3, :32] = torch.tensor([-4.0, 4.0] * 16)  # two values of equal magnitude: the first one sets the sign
    x[4, :32] = torch.tensor([63.5] + [0.5 * k for k in range(31)])  # q8_0 ties at x * 127 / amax
    return x


@pytest.mark.parametrize("d", [32, 64, 320])
@pytest.mark.parametrize("name", GGUF_PY)
def test_bytes_equal_gguf_py(name, d):
    from gguf import GGMLQuantizationType, quants

    x = rows(48, d)
    ours = ggml_quantize(x, name).reshape(48, -1).numpy()
    ref = quants.quantize(x.numpy(), GGMLQuantizationType[name.upper()])
    if name == "q8_0":  # gguf-py ports ggml's portable reference (round half away, x * (1/d)); the CPU rounds
        differ = np.argwhere(ours != ref)[:, 0]  # half to even with 127/amax: only the tie row may differ
        assert set(differ.tolist()) <= {2, 4}
        ours, ref = np.delete(ours, [2, 4], 0), np.delete(ref, [2, 4], 0)
    np.testing.assert_array_equal(ours, ref)
    # gguf-py's dequantizer reads our bytes as ours does
    np.testing.assert_array_equal(quants.dequantize(ggml_quantize(x, name).reshape(48, -1).numpy(),
                                                    GGMLQuantizationType[name.upper()]),
                                  ggml_dequantize(ggml_quantize(x, name), name).reshape(48, d).numpy())


@pytest.mark.parametrize("name", list(GGML_TYPES))
@pytest.mark.parametrize("shape", [(3, 64), (2, 3, 5, 64), (7, 320)])
def test_roundtrip_shapes_and_fake_quant(name, shape):
    x = torch.randn(shape, dtype=torch.float64)
    blocks = ggml_quantize(x, name)
    assert blocks.dtype == torch.uint8 and blocks.shape == (*shape[:-1], shape[-1] // 32, GGML_TYPES[name].block_bytes)
    values = ggml_dequantize(blocks, name)
    assert values.shape == x.shape and values.dtype == torch.float32
    fq = ggml_fake_quant(x, name)
    assert fq.dtype == x.dtype
    torch.testing.assert_close(fq.float(), values, rtol=0, atol=0)
    # the quantization error is bounded by the block's step (half a step for rounding, a full step for truncation
    # clipping: q4_0's far end clips at 7/8 of the largest magnitude)
    b = x.float().reshape(*shape[:-1], -1, 32)
    step = (b.amax(-1) - b.amin(-1)) if GGML_TYPES[name].has_min else 2 * b.abs().amax(-1)
    levels = {8: 255, 4: 15, 5: 31}[GGML_TYPES[name].code_bits]
    err = (values.reshape(b.shape) - b).abs().amax(-1)
    bound = step / levels * (1.0 if name != "iq4_nl" else 2.5) + 1e-3 * b.abs().amax(-1)
    assert bool((err <= bound).all())


def test_q4_0_reads_back_the_largest_value_exactly_and_clips_the_other_end():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = -8.0, 8.0  # max is the FIRST of equal magnitudes: -8 -> d = 1
    codes, d, m = ggml_codes(x, "q4_0")
    assert m is None and float(d[0, 0]) == 1.0
    v = ggml_fake_quant(x, "q4_0")
    assert float(v[0, 0]) == -8.0 and float(v[0, 1]) == 7.0  # code 16 clamps to 15


def test_iq4_nl_levels_and_refit():
    x = torch.tensor([IQ4_NL_VALUES * 2], dtype=torch.float32) / 127.0  # exactly the levels, scale 1/127 (sign: -1)
    v = ggml_fake_quant(x, "iq4_nl")
    torch.testing.assert_close(v, x, rtol=2e-3, atol=0)  # only fp16(d) rounds


def test_zero_blocks_and_bad_input():
    z = torch.zeros(2, 64)
    for name in GGML_TYPES:
        assert bool((ggml_fake_quant(z, name) == 0).all())
    with pytest.raises(KVConvertError, match="multiple of 32"):
        ggml_quantize(torch.zeros(2, 48), "q4_0")
    with pytest.raises(KVConvertError, match="NaN"):
        ggml_quantize(torch.full((1, 32), float("nan")), "q8_0")
    with pytest.raises(KVConvertError, match="unknown llama.cpp cache type"):
        ggml_quantize(z, "q3_k")
    with pytest.raises(KVConvertError, match="must be uint8"):
        ggml_dequantize(torch.zeros(1, 2, 17, dtype=torch.uint8), "q4_0")


# ------------------------------------------------------------------------------------------------
# the engine: ggml-cpu's from_float, as llama.cpp's CPU backend writes its KV cache
# ------------------------------------------------------------------------------------------------


def _ggml_cpu_library() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("lib/libggml-cpu*.so*"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def engine_from_float():
    lib = _ggml_cpu_library()
    if lib is None:
        if os.environ.get("KVCONVERT_REQUIRE_LLAMACPP") == "1":
            pytest.fail("llama-cpp-python is required here (KVCONVERT_REQUIRE_LLAMACPP=1): bash scripts/setup_llamacpp.sh")
        pytest.skip("llama-cpp-python not installed (bash scripts/setup_llamacpp.sh)")
    for dep in sorted(lib.parent.glob("libggml-base*.so*"))[:1]:
        ctypes.CDLL(str(dep), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()

    class Traits(ctypes.Structure):  # struct ggml_type_traits_cpu (ggml-cpu.h)
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                    ("nrows", ctypes.c_int64)]

    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    from_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)

    def quantize(x: np.ndarray, name: str) -> np.ndarray:
        fn = from_float_t(cpu.ggml_get_type_traits_cpu(GGML_TYPE_IDS[name]).contents.from_float)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros((x.shape[0], x.shape[1] // 32 * GGML_TYPES[name].block_bytes), dtype=np.uint8)
        for r in range(x.shape[0]):
            fn(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
        return out
    return quantize


@pytest.mark.llamacpp
@pytest.mark.parametrize("name", list(GGML_TYPES))
def test_bytes_equal_the_engine(engine_from_float, name):
    x = rows(256, 320, seed=3)
    ours = ggml_quantize(x, name)
    ref = engine_from_float(x.numpy(), name)
    if name == "iq4_nl":  # a block with scale 0 keeps whatever codes ggml's scratch held: compare the rest
        live = ours[..., :2].reshape(256, -1, 2).view(torch.float16)[..., 0] != 0  # [rows, blocks]
        ref_blocks = torch.from_numpy(ref).reshape(256, -1, 18)
        assert torch.equal(ours[live], ref_blocks[live])
        assert bool((ref_blocks[~live][..., :2] == 0).all())
    else:
        np.testing.assert_array_equal(ours.reshape(256, -1).numpy(), ref)


@pytest.mark.parametrize("value, on", [(None, True), ("", True), ("0", True), ("abc", True), ("0x1", True),
                                       ("1", False), ("2", False), ("1.5", False), ("1abc", False), (" -1", False)])
def test_the_rotation_switch_reads_as_llama_cpps_atoi(monkeypatch, value, on):
    """llama.cpp turns its rotation off when atoi(LLAMA_ATTN_ROT_DISABLE) is not 0; the emulation follows the same
    reading, so "1.5" or "1abc" (atoi: 1) is off in both, not on in one of them."""
    from kvconvert.ggml_formats import ROTATION_ENV, c_atoi, llamacpp_frames, rotation_enabled

    if value is None:
        monkeypatch.delenv(ROTATION_ENV, raising=False)
    else:
        monkeypatch.setenv(ROTATION_ENV, value)
        assert c_atoi(value) == ctypes.CDLL(None).atoi(value.encode())  # the C library's own atoi
    assert rotation_enabled() is on
    assert (llamacpp_frames("q4_0", "q4_0", 64, False)["k"].rotation is not None) is on


def test_the_rotation_help_says_how_the_switch_is_read(capsys):
    from kvconvert.commands.main import main

    try:
        main(["validate", "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    assert "unless it is 1" not in text and "with C's atoi" in text and "multiple of 64" in text


def _two_difference_level(y: torch.Tensor) -> torch.Tensor:
    """ggml's best_index_int8 as it is written: bracket by the levels, then ``y - lower < upper - y`` in fp32."""
    levels = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)
    upper = torch.searchsorted(levels, y, right=True).clamp(1, len(levels) - 1)
    idx = torch.where(y - levels[upper - 1] < levels[upper] - y, upper - 1, upper)
    idx = torch.where(y <= levels[0], torch.zeros_like(idx), idx)
    return torch.where(y >= levels[-1], torch.full_like(idx, len(levels) - 1), idx)


def test_iq4_nl_level_search_is_ggmls_around_every_midpoint():
    """The bucketize over midpoints picks ggml's level on values 0-64 ulps either side of each midpoint (where the
    two forms could part), at the midpoint itself (a tie: the upper level), and on 10^6 values across the range."""
    levels = IQ4_NL_VALUES
    mids = torch.tensor([(a + b) / 2 for a, b in zip(levels, levels[1:])], dtype=torch.float32)
    near = [mids]
    for direction in (float("inf"), float("-inf")):
        y = mids.clone()
        for _ in range(64):
            y = torch.nextafter(y, torch.full_like(y, direction))
            near.append(y)
    spread = torch.rand(1_000_000, generator=torch.Generator().manual_seed(0)) * 300 - 150
    for y in (torch.cat(near), spread, torch.tensor([-127.0, 113.0, 0.0, -1e-30, 1e-30, 1e9, -1e9])):
        assert torch.equal(_nearest_level(y), _two_difference_level(y))
    assert _nearest_level(mids).tolist() == list(range(1, 16))  # ties go up, as ggml's strict < sends them
