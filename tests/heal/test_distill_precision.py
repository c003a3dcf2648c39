"""Mixed precision in the Distiller (speed and memory): the frozen matmul weights stored once in
the autocast dtype give bit-identical logits and gradients to autocast's per-step casts, and the prepared
student returns its logits in the autocast dtype (not accelerate's float32 copy, which would double the
two vocabulary-sized tensors kvconvert.heal.memory counts)."""

from __future__ import annotations

import torch

from kvconvert.heal.distill import Distiller, attach_trainable, store_frozen_matmuls_in
from kvconvert.heal.options import DistillOptions
from kvconvert.quant.capture import load_hf_model


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_frozen_matmuls_in_bf16_are_bit_identical_to_autocast(tiny_student):
    stage = DistillOptions(mixed_precision="bf16", targets=("q_proj", "kv_b_proj"), device="cpu")
    model = load_hf_model(tiny_student)
    attach_trainable(model, stage)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_grads = _logits_and_grads(model, ids)

    cast = store_frozen_matmuls_in(model, torch.bfloat16)
    layer = model.model.layers[0]
    assert layer.mlp.gate_proj.weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    assert layer.self_attn.o_proj.weight.dtype == torch.bfloat16  # frozen here: not a target
    assert layer.self_attn.q_proj.parametrizations.weight.original.dtype == torch.float32  # trained: master copy
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the residual stream stays float32
    assert layer.input_layernorm.weight.dtype == torch.float32
    assert cast > 0.5 * sum(p.numel() for p in model.parameters())

    logits, grads = _logits_and_grads(model, ids)
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_prepared_student_returns_logits_in_the_autocast_dtype(tiny_student, tiny_teacher, tmp_path):
    stage = DistillOptions(mixed_precision="bf16", tokens=2 * 2 * 64, seq_len=64, batch_size=2, device="cpu",
                           warmup_steps=0, checkpoint_every=0)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    d = Distiller(tiny_student, tiny_teacher, ids, stage, tmp_path, fingerprint="t", progress=False)
    with torch.no_grad(), d.accelerator.autocast():
        assert d.student(input_ids=ids[:1]).logits.dtype == torch.bfloat16
    record = d.train_step()
    assert record["loss"] > 0 and torch.isfinite(torch.tensor(record["grad_norm"]))


def test_compile_under_fsdp_is_refused_before_loading(tiny_student, tiny_teacher, tmp_path, monkeypatch):
    import pytest

    from kvconvert.errors import KVConvertError

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    stage = DistillOptions(compile=True, tokens=2 * 64, seq_len=64, device="cpu", checkpoint_every=0)
    ids = torch.zeros((2, 64), dtype=torch.long)
    with pytest.raises(KVConvertError, match="compile is not supported under FSDP"):
        Distiller(tiny_student, tiny_teacher, ids, stage, tmp_path, fingerprint="t", progress=False)
