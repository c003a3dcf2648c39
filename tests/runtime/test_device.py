"""The runtime's device plumbing, testable without a GPU: cpu and auto (cpu here) give the same logits
bit for bit (weights mapped from the files on the CPU: tests/runtime/test_dtype.py), the meta device
runs prefill and decode with every weight, cache and step tensor on it (a tensor left on the CPU
raises there, as it would on a GPU), and asking for cuda without one is a clear error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.runtime import LLM, SamplingParams
from runtime_cases import assert_bf16_logits_close, load_reference, random_ids

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="auto means cuda on this machine")


def model_tensors(llm) -> list[torch.Tensor]:
    """Every weight, RoPE table, cache tensor and kv scale of an engine."""
    m, found = llm.model, [llm.model.embed, llm.model.norm, llm.model.lm_head, llm.model.cos, llm.model.sin]

    def walk(obj):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif dataclasses.is_dataclass(value):
                walk(value)
    for layer in [*m.layers, *llm.cache.layers]:  # the cache's layers are dataclasses too (kernels' layouts)
        walk(layer)
    return found


@no_gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_cpu_and_auto_give_identical_logits(tiny_model, kv_dtype):
    ids = [3, 17, 42, 5, 9, 11, 60, 2, 7]
    runs = {}
    for device in ("cpu", "auto", None):
        kw = {} if device is None else {"device": device}
        llm = LLM(tiny_model, kv_dtype=kv_dtype, kv_scales="dynamic", num_blocks=8, block_size=4, **kw)
        assert llm.device == torch.device("cpu") and all(t.device.type == "cpu" for t in model_tensors(llm))
        runs[device] = (llm.score(ids), llm.generate([ids], SamplingParams(max_tokens=6, seed=1))[0].token_ids)
    for device in ("auto", None):
        assert torch.equal(runs[device][0], runs["cpu"][0]) and runs[device][1] == runs["cpu"][1]


def test_meta_device_runs_prefill_and_decode_on_the_device(tiny_model):
    """(bf16 cache only: the fp8/nvfp4 writes check for NaN on the host, which meta cannot answer)"""
    llm = LLM(tiny_model, num_blocks=8, block_size=4, device=torch.device("meta"))
    assert all(t.device.type == "meta" for t in model_tensors(llm))
    for prompt in ([3, 17, 42, 5, 9, 11], [8, 1]):
        llm.add_request(prompt, SamplingParams(max_tokens=4))
    prefill = llm.scheduler.schedule()
    llm.scheduler.update(prefill, {it.seq.seq_id: 5 for it in prefill.scheduled})
    decode = llm.scheduler.schedule()
    assert all(it.num_new_tokens == 1 for it in decode.scheduled) and len(decode.scheduled) == 2
    for step in (prefill, decode):
        ids, positions, meta = llm.runner.prepare(step.scheduled)
        hidden = llm.model.forward(ids, positions, llm.cache, meta, llm.attention)
        logits = llm.model.logits(hidden)
        assert hidden.device.type == "meta" and logits.shape == (ids.numel(), llm.model.vocab_size)


def test_cuda_without_a_gpu_is_a_clear_error(llama_gqa, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KVConvertError, match="asked for a GPU, but torch sees none.*--device cpu"):
        LLM(llama_gqa, device="cuda")
    with pytest.raises(KVConvertError, match="not a device"):
        LLM(llama_gqa, device="gpu0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_bf16_logits_match_transformers_on_the_gpu(tiny_model, backend):
    """Runtime on cuda in bf16 against transformers on cuda in fp32 with the same (bf16-rounded)
    weights: the bf16-activation tolerance of tests/runtime/test_dtype.py. Triton compiles its
    kernels when TRITON_INTERPRET=0."""
    ids = torch.tensor(random_ids(120, seed=3))
    llm = LLM(tiny_model, device="cuda", dtype="bf16", attention_backend=backend, block_size=16)
    assert all(t.device.type == "cuda" for t in model_tensors(llm))
    got = llm.score(ids.tolist())
    hf = load_reference(tiny_model)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        ref = hf.cuda()(input_ids=ids[None].cuda()).logits[0].float().cpu()
    assert_bf16_logits_close(got, ref)
