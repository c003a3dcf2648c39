"""Quantized KV storage (fp8 e4m3 / e5m2, int8, nvfp4) against transformers with fake-quantized K/V.

The reference runs transformers' model with kvconvert.quant's hook cache (KVHookCache +
fake_quant_hook: the quantize-dequantize of kvconvert.number_formats applied to what an engine
caches; Llama: post-RoPE k and v per head; DeepSeek: the row [latent | k_rope], k_rope kept bf16 by
nvfp4). Attention then reads only quantized values on both sides, so fp32 logits agree to rounding
(atol 1e-4; a K/V value sitting on a rounding boundary could flip one code, which the greedy check
would expose) and greedy tokens are identical. Scales are calibrated amax / the format's divisor (448,
57344, 127) shrunk by 0.7 so some values saturate. INT8 is stored as TensorRT-LLM stores it: K and V of a
layer at one scale, max(k_scale, v_scale), whatever the checkpoint holds.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvconvert.checkpoint import read_config
from kvconvert.errors import KVConvertError
from kvconvert.kvformat import kv_format
from kvconvert.kvmath import kv_shape
from kvconvert.quant.capture import KVHookCache
from kvconvert.quant.hooks import fake_quant_hook
from kvconvert.quant.scales import KVScales
from kvconvert.runtime import LLM
from runtime_cases import add_tensors, greedy, load_reference, random_ids, transformers_reference

kv_scale_from_amax = kv_format("fp8").scale_from_amax  # amax / 448: FP8 E4M3 and NVFP4 alike

ATOL = 1e-4


def fake_quant_cache(ref, path, kv_dtype: str, scales) -> KVHookCache:
    """transformers' cache of `ref` (the model at path) with every K/V fake-quantized on the way in.
    scales: per layer (k, v), each [] or [kv_heads]."""
    shape = kv_shape(read_config(path))
    granularity = "head" if scales[0][0].dim() else "tensor"
    kv_scales = KVScales(kv_dtype, granularity, shape.kind, [k for k, _ in scales], [v for _, v in scales])
    return KVHookCache(fake_quant_hook(shape, kv_scales), config=ref.config)


def _calibrate(ref, prompt, per_head: bool, mla: bool, kv_dtype: str = "fp8"):
    """Per-layer kv scales = 0.7 * amax / the format's divisor of the K/V (MLA: the whole cached row)."""
    kv_scale_from_amax = kv_format(kv_dtype).scale_from_amax
    cache = DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    scales = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values  # Llama [1, H, S, D]; MLA latent / k_rope [1, 1, S, *]
        if mla:
            s = 0.7 * kv_scale_from_amax(torch.cat([k, v], -1).abs().amax())
            scales.append((s, s))
        elif per_head:
            scales.append(tuple(0.7 * kv_scale_from_amax(t.abs().amax(dim=(0, 2, 3))) for t in (k, v)))
        else:
            scales.append(tuple(0.7 * kv_scale_from_amax(t.abs().amax()) for t in (k, v)))
    return scales


def _with_scales(src, dst, scales, naming: str, mla: bool = False):
    """vLLM names (per head as llm-compressor writes them, [H, 1, 1]) or ModelOpt names (MLA: the
    kv_a_proj_with_mqa.k_scale name SGLang remaps)."""
    extra = {}
    for i, (k, v) in enumerate(scales):
        prefix = f"model.layers.{i}.self_attn."
        if naming == "vllm":
            shape = (-1, 1, 1) if k.numel() > 1 else (1,)
            extra[prefix + "k_scale"] = k.float().reshape(shape).clone()
            extra[prefix + "v_scale"] = v.float().reshape(shape).clone()
        elif mla:
            extra[prefix + "kv_a_proj_with_mqa.k_scale"] = k.float().reshape(()).clone()
        else:
            extra[prefix + "k_proj.k_scale"] = k.float().reshape(-1).clone()
            extra[prefix + "v_proj.v_scale"] = v.float().reshape(-1).clone()
    return add_tensors(src, dst, extra)


CASES = [
    ("llama", "fp8", "vllm", False),
    ("llama", "fp8_e5m2", "vllm", False),
    ("llama", "fp8", "modelopt", True),
    ("llama", "fp8", "vllm", True),
    ("llama", "nvfp4", "modelopt", True),
    ("llama", "nvfp4", "vllm", False),
    ("deepseek", "fp8", "vllm", False),
    ("deepseek", "fp8", "modelopt", False),
    ("deepseek", "nvfp4", "vllm", False),
    ("deepseek", "nvfp4_fp8rope", "vllm", False),
    ("deepseek", "nvfp4_fp8rope", "modelopt", False),
    ("llama", "int8", "modelopt", False),
    ("llama", "int8", "vllm", True),  # per-head scales: the runtime reads them (TensorRT-LLM does not)
    ("deepseek", "int8", "modelopt", False),
]


def _engine_scales(scales, kv_dtype: str):
    """The scales the engine stores K and V with: one per layer, max(k, v), for a shared-scale format (int8)."""
    if not kv_format(kv_dtype).shared_kv_scale:
        return scales
    return [(torch.maximum(k, v),) * 2 for k, v in scales]


@pytest.mark.parametrize("arch, kv_dtype, naming, per_head", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_quantized_cache_matches_fake_quant_reference(arch, kv_dtype, naming, per_head, llama_gqa, deepseek_mla,
                                                       tmp_path):
    src = llama_gqa if arch == "llama" else deepseek_mla
    mla = arch == "deepseek"
    ref = load_reference(src)
    prompt = random_ids(20)
    scales = _calibrate(ref, random_ids(40, seed=1), per_head, mla, kv_dtype)
    path = _with_scales(src, tmp_path / "scaled", scales, naming, mla)
    ref_logits, ref_tokens = transformers_reference(
        ref, prompt, 24, lambda: fake_quant_cache(ref, src, kv_dtype, _engine_scales(scales, kv_dtype)))
    with torch.no_grad():
        exact = ref(torch.tensor([prompt])).logits[0]
    assert (ref_logits - exact).abs().max() > 10 * ATOL, "quantization too weak for this test to see it"

    llm = LLM(path, kv_dtype=kv_dtype, block_size=4, max_num_batched_tokens=8)
    torch.testing.assert_close(llm.score(prompt), ref_logits, atol=ATOL, rtol=0)
    out = llm.generate([prompt], greedy(24))[0]
    assert out.token_ids == ref_tokens


def test_mla_only_format_is_refused_for_per_head_kv(llama_gqa):
    with pytest.raises(KVConvertError, match="nvfp4_fp8rope .*per-head K and V.*--kv-dtype nvfp4"):
        LLM(llama_gqa, kv_dtype="nvfp4_fp8rope", kv_scales="dynamic")


def test_dynamic_scales_use_the_first_prefill_amax(llama_gqa):
    """Layer 0's scale is amax/448 of the prompt's K (its input does not depend on quantization);
    deeper layers' scales see quantized inputs, so the reference reuses the runtime's scales."""
    ref = load_reference(llama_gqa)
    prompt = random_ids(30, seed=2)
    cache = DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    with pytest.warns(UserWarning, match="dynamic"):
        llm = LLM(llama_gqa, kv_dtype="fp8", kv_scales="dynamic")
    out = llm.generate([prompt], greedy(16))[0]
    layer0 = llm.cache.layers[0]
    torch.testing.assert_close(layer0.k_scale, kv_scale_from_amax(cache.layers[0].keys.abs().amax()).reshape(1))
    torch.testing.assert_close(layer0.v_scale, kv_scale_from_amax(cache.layers[0].values.abs().amax()).reshape(1))
    scales = [(layer.k_scale.reshape(()), layer.v_scale.reshape(())) for layer in llm.cache.layers]
    _, ref_tokens = transformers_reference(ref, prompt, 16, lambda: fake_quant_cache(ref, llama_gqa, "fp8", scales))
    assert out.token_ids == ref_tokens


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_missing_scales_are_an_error_not_scale_one(tiny_model, kv_dtype):
    with pytest.raises(KVConvertError, match=r"k_scale.*kv_scales='dynamic'"):
        LLM(tiny_model, kv_dtype=kv_dtype)


@pytest.mark.parametrize("arch, value, match", [
    ("llama", torch.tensor([0.0]), "zero, negative or non-finite"),
    ("llama", torch.tensor([1.0, 2.0, 3.0]), "expected one value or one per KV head"),
    ("deepseek", torch.ones(4), "per-tensor scale only"),  # MLA caches one row: no per-head scales
])
def test_bad_scales_are_rejected(llama_gqa, deepseek_mla, tmp_path, arch, value, match):
    extra = {f"model.layers.{i}.self_attn.{n}_scale": value.clone() for i in range(2) for n in "kv"}
    with pytest.raises(KVConvertError, match=match):
        LLM(add_tensors(llama_gqa if arch == "llama" else deepseek_mla, tmp_path / "bad", extra), kv_dtype="fp8")


def test_triton_backend_refuses_an_int8_cache(llama_gqa):
    """No Triton kernel reads INT8 codes: refused before any weight is read, naming the backend that does."""
    with pytest.raises(KVConvertError, match=r"Triton kernels do not read an INT8 cache \(int8\).*--backend torch"):
        LLM(llama_gqa, kv_dtype="int8", kv_scales="dynamic", attention_backend="triton")


def test_int8_dynamic_scales_are_one_per_layer(llama_gqa):
    """kv_scales='dynamic' under int8: K and V of layer 0 at one scale, amax of both / 127 (layer 0's K/V do
    not depend on the cache), as the engine stores them."""
    ref = load_reference(llama_gqa)
    prompt = random_ids(30, seed=2)
    cache = DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    with pytest.warns(UserWarning, match=r"amax / 127; K and V stored with max"):
        llm = LLM(llama_gqa, kv_dtype="int8", kv_scales="dynamic")
    llm.generate([prompt], greedy(4))
    amax = torch.maximum(cache.layers[0].keys.abs().amax(), cache.layers[0].values.abs().amax())
    layer0 = llm.cache.layers[0]
    assert layer0.k.dtype == torch.int8
    torch.testing.assert_close(layer0.k_scale, (amax / 127).reshape(1))
    assert torch.equal(layer0.k_scale, layer0.v_scale)
