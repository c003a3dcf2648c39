"""Weights in their stored dtype: bf16 checkpoints run in bf16, mapped from the files (not copied),
fp32 on request; the up-front memory estimate and refusal."""

from __future__ import annotations

import ctypes

import pytest
import torch
from safetensors.torch import save_file

from kvconvert.checkpoint import CheckpointReader
from kvconvert.errors import KVConvertError
from kvconvert.runtime import LLM
from kvconvert.memory import AVAILABLE_ENV, resolve_dtype
from kvconvert.runtime.memory import estimate_memory
from runtime_cases import add_tensors, assert_bf16_logits_close, greedy, random_ids

IDS = random_ids(120, seed=3)


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def bf16_model(request, tmp_path_factory, llama_gqa, deepseek_mla):
    """The tiny fp32 checkpoint re-stored in bf16 (as real checkpoints ship)."""
    src = llama_gqa if request.param == "llama" else deepseek_mla
    dst = tmp_path_factory.mktemp(f"{request.param}_bf16")
    return add_tensors(src, dst, {}, {"torch_dtype": "bfloat16"}, dtype=torch.bfloat16)


def _inside(tensor: torch.Tensor, mm) -> bool:
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return base <= tensor.data_ptr() < base + len(mm)


def test_mapped_tensors_are_views_of_the_file_and_equal_get(bf16_model):
    with CheckpointReader(bf16_model) as reader:
        name = "model.layers.0.mlp.down_proj.weight"
        view = reader.mapped(name)
        mm = reader._maps["model.safetensors"][0]
        assert view.dtype == torch.bfloat16 and _inside(view, mm)  # no copy
        assert torch.equal(view, reader.get(name))
        converted = reader.mapped(name, torch.float32)  # another dtype: a converted copy
        assert converted.dtype == torch.float32 and not _inside(converted, mm)
        assert torch.equal(converted, view.float())


def test_auto_dtype_keeps_bf16_weights_mapped(bf16_model):
    llm = LLM(bf16_model, kv_dtype="bf16")
    assert llm.dtype == torch.bfloat16 and llm.model.dtype == torch.bfloat16
    layer = llm.model.layers[0]
    assert layer.mlp.down_proj.dtype == torch.bfloat16
    # the weight's memory is the file mapping, shared with nothing Python allocated
    assert not layer.mlp.down_proj.untyped_storage().resizable()
    fp32 = LLM(bf16_model, kv_dtype="bf16", dtype="fp32")
    assert fp32.model.layers[0].mlp.down_proj.dtype == torch.float32


def test_bf16_logits_match_fp32_logits(bf16_model):
    """Same (bf16) weights, bf16 vs fp32 activations (tolerances: assert_bf16_logits_close)."""
    ref = LLM(bf16_model, kv_dtype="fp32", dtype="fp32").score(IDS)
    got = LLM(bf16_model, kv_dtype="bf16").score(IDS)
    assert got.dtype == torch.float32
    assert_bf16_logits_close(got, ref)


def test_fp32_logits_of_bf16_weights():
    """fp32_logits multiplies in fp32 whatever the weight dtype (no bf16 rounding of the output)."""
    from kvconvert.runtime.layers import LOGIT_CHUNK, fp32_logits

    g = torch.Generator().manual_seed(0)
    w = torch.randn(LOGIT_CHUNK + 100, 32, generator=g).to(torch.bfloat16)
    h = torch.randn(3, 32, generator=g)
    exact = h.double() @ w.double().T
    assert torch.allclose(fp32_logits(h, w).double(), exact, rtol=0, atol=1e-4)
    assert float((torch.nn.functional.linear(h.bfloat16(), w).double() - exact).abs().max()) > 1e-3


def test_resolve_dtype():
    assert resolve_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_dtype(None, torch.float32) == torch.float32
    assert resolve_dtype("fp32", torch.bfloat16) == torch.float32
    assert resolve_dtype("auto", torch.float8_e4m3fn) == torch.float32
    with pytest.raises(KVConvertError, match="--dtype"):
        resolve_dtype("int4", torch.bfloat16)


def test_estimate_memory_tinyllama_by_hand():
    """TinyLlama-1.1B: 22 layers, hidden 2048, 32 q / 4 kv heads (head_dim 64), MLP 5632, vocab 32000."""
    cfg = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
           "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
           "max_position_embeddings": 2048, "tie_word_embeddings": False}
    per_layer = 2048 * 2048 * 2 + 2048 * 256 * 2 + 3 * 2048 * 5632 + 2 * 2048
    params = 22 * per_layer + 2 * 32000 * 2048 + 2048
    assert params == 1_100_048_384  # TinyLlama's published 1.1B
    est = estimate_memory(cfg, torch.bfloat16, kv_cache_bytes=10**8, tokens_per_step=512, context=2048)
    assert est.weights == 2 * params + 4 * 32000 * 2048 and est.kv_cache == 10**8  # + lm_head's kept fp32 copy
    assert est.activations == 4 * (512 * (6 * 2048 + 3 * 5632 + 2 * 32000) + 32 * 512 * 2048)
    assert est.total == est.weights + est.kv_cache + est.activations + est.overhead
    assert estimate_memory(cfg, torch.float32).weights == 4 * params


def test_refuses_up_front_and_names_the_option_that_fits(llama_gqa, monkeypatch):
    llm = LLM(llama_gqa, kv_dtype="bf16", dtype="fp32", num_blocks=4)
    fp32 = llm.memory_estimate(llm.model.config, torch.float32).total
    bf16 = llm.memory_estimate(llm.model.config, torch.bfloat16).total
    monkeypatch.setenv(AVAILABLE_ENV, str((fp32 + bf16) // 2) + "B")
    with pytest.raises(KVConvertError, match=r"needs about .* only .* available; use --dtype bf16"):
        LLM(llama_gqa, kv_dtype="bf16", dtype="fp32", num_blocks=4)
    LLM(llama_gqa, kv_dtype="bf16", dtype="bf16", num_blocks=4)  # fits
    monkeypatch.setenv(AVAILABLE_ENV, "1000B")
    with pytest.raises(KVConvertError, match="more memory"):
        LLM(llama_gqa, kv_dtype="bf16", num_blocks=4)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_triton_decode_of_bf16_model_matches_torch(bf16_model, kv_dtype):
    """bf16 queries through the Triton decode kernels (interpreter on a CPU) give the torch
    backend's greedy tokens, except where the two rank a near-tie differently: the first token
    where they part must be one where the fp32 reference's top two logits are within 0.1 (seen:
    deepseek, 2.869 vs 2.831; the kernel, accumulating in fp32, picked the fp32 reference's token,
    the torch path, which rounds the probabilities to bf16, the other)."""
    params = greedy(6)
    prompt = IDS[:20]
    torch_out, triton_out = (
        LLM(bf16_model, kv_dtype=kv_dtype, kv_scales="dynamic", attention_backend=backend, block_size=16)
        .generate([prompt], params)[0].token_ids for backend in ("torch", "triton"))
    assert torch_out[0] == triton_out[0]  # from the (shared) prefill
    parted = next((i for i, (a, b) in enumerate(zip(torch_out, triton_out)) if a != b), None)
    if parted is not None:
        ref = LLM(bf16_model, kv_dtype="fp32", dtype="fp32").score(prompt + torch_out[:parted])[-1]
        top = ref.topk(2).values
        assert float(top[0] - top[1]) < 0.1, (torch_out, triton_out)


def _rss_file_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status RssFile (not Linux)")


def test_converted_reads_leave_no_mapped_pages_resident(tmp_path):
    """dtype != stored: the fp32 copy is made and the bf16 source pages are dropped (MADV_DONTNEED),
    so an fp32 load costs 4 bytes per parameter, not 6; mapped views keep theirs (they are the weights)."""
    big = torch.randn(8192, 4096).to(torch.bfloat16)  # 64 MiB
    save_file({"w": big}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    with CheckpointReader(tmp_path) as reader:
        before = _rss_file_mb()
        converted = reader.mapped("w", torch.float32)
        assert torch.equal(converted, big.float())
        assert _rss_file_mb() - before < 16
        view = reader.mapped("w")
        float(view.float().sum())  # touch every page
        assert _rss_file_mb() - before > 48
