"""How vLLM's CPU build really stores an FP8 KV cache, and kvconvert's emulation of it.

vLLM CPU's cache write (csrc/cpu/cpu_attn_fp8.hpp) truncates toward zero; kvconvert, the bundled
runtime and GPU engines round to nearest even. kvconvert.number_formats.fp8_quantize(rounding=
"toward_zero") is the emulation `validate --engine vllm` uses (kvconvert.engines.vllm.FP8_ROUNDING).
The first tests hold it against the kernel's formula (no vLLM needed); the `vllm` ones run the
installed kernel itself on the same values (a bare kernel call: no model, a few seconds).
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvconvert.engines.vllm import FP8_ROUNDING
from kvconvert.number_formats import fp8_quantize

vllm = pytest.mark.vllm


def kernel_e4m3(v: torch.Tensor) -> torch.Tensor:
    """vLLM's float_to_fp8e4m3_scalar transcribed (v already times 1/scale): clamp to +-448, take
    the fp32 bits of v * 2^-120, sign | bits 20..26 (capped at 0x7E), i.e. the top 3 mantissa bits."""
    v = v.float().clamp(-448, 448)
    bits = (v * 2.0 ** -120).contiguous().view(torch.int32)
    code = ((bits >> 24) & 0x80) | ((bits >> 20) & 0x7F).clamp(max=0x7E)
    return torch.where(v == 0, 0, code).to(torch.uint8)


def kernel_e5m2(v: torch.Tensor) -> torch.Tensor:
    """vLLM's float_to_fp8e5m2_scalar transcribed: top 2 mantissa bits; below 2^-14 the subnormal
    mantissa (1.m >> shift), truncated too."""
    v = v.float().clamp(-57344, 57344)
    bits = v.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    sign = (bits >> 24) & 0x80
    exp = ((bits >> 23) & 0xFF) - 127
    normal = sign | ((exp + 15).clamp(min=0) << 2) | ((bits >> 21) & 3)
    shift = (-14 - exp).clamp(min=0, max=40)
    sub = ((0x800000 | (bits & 0x7FFFFF)) >> (shift + 21).clamp(max=63)).clamp(max=3)
    code = torch.where(exp < -14, sign | sub, normal)
    return torch.where(v == 0, 0, code).to(torch.uint8)


def probe_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite FP8 value, its fp32 neighbours on both sides, midpoints, out-of-range and random values."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    codes = codes[torch.isfinite(codes)]
    up, down = torch.full_like(codes, 1e30), torch.full_like(codes, -1e30)
    sorted_codes = codes.unique()
    mids = (sorted_codes[1:] + sorted_codes[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    fmax = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
    return torch.cat([codes, torch.nextafter(codes, up), torch.nextafter(codes, down), mids,
                      torch.nextafter(mids, up[:len(mids)]), torch.nextafter(mids, down[:len(mids)]),
                      torch.randn(200_000, generator=g) * fmax / 8, torch.randn(20_000, generator=g) * 1e-3,
                      torch.tensor([fmax * 1.5, -fmax * 3, 1e-12, -1e-12])])


@pytest.mark.parametrize("dtype,kernel", [(torch.float8_e4m3fn, kernel_e4m3), (torch.float8_e5m2, kernel_e5m2)])
def test_toward_zero_is_the_vllm_cpu_kernel_bit_for_bit(dtype, kernel):
    y = probe_values(dtype)
    got = fp8_quantize(y, 1.0, dtype, rounding="toward_zero")
    want = kernel(y)
    bad = (got.view(torch.uint8) != want) & (got.float() != want.view(dtype).float())  # +-0 alike
    assert not bad.any(), (y[bad][:5].tolist(), got.view(torch.uint8)[bad][:5].tolist(), want[bad][:5].tolist())
    # never away from zero (but for E4M3's subnormal quirk: within 2^-29, see fp8_quantize), and
    # never more than one code below round-to-nearest
    assert (got.float().abs() <= y.abs().clamp(max=got.float().abs().max()) + 2.0 ** -29).all()
    nearest = fp8_quantize(y, 1.0, dtype)
    assert ((nearest.view(torch.uint8).int() - got.view(torch.uint8).int()).abs() <= 1).all()


def test_toward_zero_biases_magnitudes_down_and_doubles_the_rms_error():
    """What makes vLLM CPU's FP8 cache costlier than round-to-nearest with the same scales: the
    truncated values are ~4.5% smaller on average (half a mantissa step) and their RMS error is
    2x RNE's (a uniform error over one step instead of half a step each side)."""
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(1))
    scale = float(x.abs().max()) / 448
    errors = {}
    for rounding in ("nearest", "toward_zero"):
        x_hat = fp8_quantize(x, scale, rounding=rounding).float() * scale
        big = x.abs() > 64 * scale  # normal range: relative errors
        errors[rounding] = ((x_hat - x)[big] / x[big])
    assert abs(float(errors["nearest"].mean())) < 3e-3  # measured -1.3e-3; truncation -4.5e-2
    assert -0.05 < float(errors["toward_zero"].mean()) < -0.04
    ratio = float(errors["toward_zero"].square().mean().sqrt() / errors["nearest"].square().mean().sqrt())
    assert 1.8 < ratio < 2.2, ratio  # measured 1.91


KERNEL_SCRIPT = r"""
import json, math, sys, torch
from safetensors.torch import load_file, save_file
import vllm._custom_ops as ops
from vllm.platforms import current_platform

t = load_file(sys.argv[1])
k, v, q, ks, vs = t["k"], t["v"], t["q"], float(t["k_scale"]), float(t["v_scale"])
T, kvh, d = k.shape
block = 32
nblk = (T + block - 1) // block
cache = torch.zeros(nblk, kvh, 2 * block, d, dtype=torch.uint8)  # vLLM's CPU layout, K then V per block
key_cache, value_cache = cache.chunk(2, dim=2)
slots = torch.arange(T, dtype=torch.long)
ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec", k_scale=ks, v_scale=vs,
                               kv_cache_dtype="fp8")
# the vec ISA stores K column-major per block ([d, block]) and V row-major ([block, d])
k_codes = key_cache.reshape(nblk, kvh, d, block).permute(0, 3, 1, 2).reshape(nblk * block, kvh, d)[:T]
v_codes = value_cache.permute(0, 2, 1, 3).reshape(nblk * block, kvh, d)[:T]
qsl, seq = torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32)
heads = q.shape[1]
meta = ops.cpu_attn_get_scheduler_metadata(1, heads, kvh, d, seq, torch.float32, qsl, True, -1, "vec", False,
                                           None, "fp8")
out = torch.zeros_like(q)
ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, qsl, seq, 1 / math.sqrt(d), True, None, -1,
                                torch.arange(nblk, dtype=torch.int32)[None], 0.0, meta, None, None, ks, vs, "fp8")
save_file({"k_codes": k_codes.contiguous(), "v_codes": v_codes.contiguous(), "out": out}, sys.argv[2])
print(json.dumps({"platform": current_platform.device_type}))
"""


def causal_attention(q, k, v):
    """fp64 causal GQA attention, q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    s = torch.einsum("thd,shd->hts", q.double(), k) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v).float()


@vllm
def test_vllm_cpu_fp8_cache_is_truncated_and_prefill_attends_to_it(tmp_path, vllm_fp8):
    """The installed vLLM CPU kernels: the cache write stores exactly kvconvert's toward_zero codes
    (K and V), and the prefill attention output equals fp32 attention over that dequantized cache with
    the query unquantized (1e-5), not over fresh K/V nor round-to-nearest ones (those differ by >1e-2)."""
    g = torch.Generator().manual_seed(0)
    T, heads, kvh, d = 80, 6, 2, 64
    q, k = torch.randn(T, heads, d, generator=g), torch.randn(T, kvh, d, generator=g) * 3
    v = torch.randn(T, kvh, d, generator=g)
    ks, vs = float(k.abs().max()) / 448, float(v.abs().max()) / 448
    save_file({"q": q, "k": k, "v": v, "k_scale": torch.tensor(ks), "v_scale": torch.tensor(vs)}, tmp_path / "in.st")
    done = subprocess.run([str(vllm_fp8), "-c", KERNEL_SCRIPT, str(tmp_path / "in.st"), str(tmp_path / "out.st")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    platform = json.loads(done.stdout.strip().splitlines()[-1])["platform"]
    rounding = FP8_ROUNDING[platform]
    assert rounding == "toward_zero"
    got = load_file(tmp_path / "out.st")
    k_q, v_q = fp8_quantize(k, ks, rounding=rounding), fp8_quantize(v, vs, rounding=rounding)
    assert torch.equal(got["k_codes"], k_q.view(torch.uint8)) and torch.equal(got["v_codes"], v_q.view(torch.uint8))
    assert (k_q.view(torch.uint8) != fp8_quantize(k, ks).view(torch.uint8)).float().mean() > 0.3

    def error(reference):
        return float((got["out"] - reference).norm() / reference.norm())

    assert error(causal_attention(q, k_q.float() * ks, v_q.float() * vs)) < 1e-5
    rne = causal_attention(q, fp8_quantize(k, ks).float() * ks, fp8_quantize(v, vs).float() * vs)
    assert error(rne) > 1e-2 and error(causal_attention(q, k, v)) > 1e-2
