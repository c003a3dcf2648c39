"""Quantization-aware distillation (kvconvert.heal.quant_aware): the training forward sees the cache the
engine will read after `calibrate`, and the backward pass goes straight through the rounding."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from quant_cases import make_deepseek  # noqa: E402

from kvconvert.heal import quant_aware  # noqa: E402
from kvconvert.heal.quant_aware import attach_cache_rounding, engine_rounding, straight_through  # noqa: E402
from kvconvert.kvmath import kv_shape  # noqa: E402
from kvconvert.quant.capture import forward_with_hook, load_hf_model  # noqa: E402

IDS = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    """rank 32 + rope 16, a non-uniform kv_a_layernorm weight (calibrate must fold it to rotate)."""
    return make_deepseek(tmp_path_factory.mktemp("qat") / "ds")


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> Path:
    """One layer: calibration observes the unrounded forward, the hook its own, so from the second layer
    on their amax differ by the first layer's rounding."""
    return make_deepseek(tmp_path_factory.mktemp("qat") / "ds1", layers=1)


def _engine_logits(folder: Path, kv_dtype: str) -> torch.Tensor:
    """Logits with the cache as the engine stores it after calibrating on IDS themselves (amax
    observer, so the scales are the amax the training hook takes per forward; no k_rope phases,
    which the hook does not emulate)."""
    from kvconvert.quant.calibrate import CalibrationSettings, calibrate_model
    from kvconvert.quant.hooks import fake_quant_hook

    model = load_hf_model(folder)
    layout = kv_shape(model.config.to_dict())
    result = calibrate_model(model, layout, IDS, CalibrationSettings(kv_dtype, observer="amax", key_phase=False,
                                                                     batch_size=2))
    return forward_with_hook(model, IDS, fake_quant_hook(layout, result.scales))


def _training_logits(folder: Path, kv_dtype: str | None) -> torch.Tensor:
    model = load_hf_model(folder)
    if kv_dtype is not None:
        attach_cache_rounding(model, kv_shape(model.config.to_dict()), kv_dtype)
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4", "nvfp4_fp8rope"])
def test_training_forward_reads_the_engines_cache(one_layer, kv_dtype, monkeypatch):
    """fp32 logits of the hooked training forward equal those of the calibrated model with its cache
    fake-quantized as stored: 1e-4 of the rounding's own effect (only fp32 rounding of the fold differs).
    Without the Hadamard (a mutation) they differ by a large part of that effect."""
    engine, exact = _engine_logits(one_layer, kv_dtype), _training_logits(one_layer, None)
    effect = (engine - exact).abs().max()
    assert effect > 1e-3  # the cache rounding is visible at all
    gap = (_training_logits(one_layer, kv_dtype) - engine).abs().max()
    assert gap <= 1e-4 * effect + 1e-5, (float(gap), float(effect))
    if kv_dtype != "fp8":  # 4-bit formats rotate the latent; fp8 stores it as it is
        monkeypatch.setattr(quant_aware, "latent_rotation", lambda layout, kv_dtype: None)
        unrotated = (_training_logits(one_layer, kv_dtype) - engine).abs().max()
        assert unrotated > 0.1 * effect, (float(unrotated), float(effect))


def test_gradient_goes_straight_through():
    x = torch.randn(1, 1, 8, 48, requires_grad=True)
    w, rotation = 0.5 + torch.rand(32), torch.linalg.qr(torch.randn(32, 32))[0]
    y = straight_through(x, engine_rounding(x, w, rotation, "nvfp4", 16))
    assert not torch.equal(y, x)
    upstream = torch.randn_like(x)
    y.backward(upstream)
    assert torch.equal(x.grad, upstream)


def test_rounding_also_under_gradient_checkpointing(deepseek):
    """Gradient checkpointing drops the model's cache argument; the per-attention pre-hook still rounds,
    and the loss and gradients equal those without checkpointing."""
    def loss_and_grad(checkpointing: bool):
        model = load_hf_model(deepseek)
        model.train()
        attach_cache_rounding(model, kv_shape(model.config.to_dict()), "nvfp4")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        return loss.detach(), model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.grad.clone()

    plain = load_hf_model(deepseek)
    plain_loss = plain(input_ids=IDS, labels=IDS).loss.detach()
    (loss_a, grad_a), (loss_b, grad_b) = loss_and_grad(False), loss_and_grad(True)
    assert abs(float(loss_a - plain_loss)) > 1e-5  # rounded
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_b, grad_a, rtol=1e-4, atol=1e-6)


def test_refuses_a_per_head_cache():
    from kvconvert.errors import KVConvertError
    from kvconvert.kvmath import GQA, KVShape

    llama = KVShape(GQA, 2, 4, num_kv_heads=2, head_dim=16)
    with pytest.raises(KVConvertError, match="not MLA"):
        quant_aware.quant_aware_hook(torch.nn.Module(), llama, "fp8")


def test_distill_trains_through_the_rounded_cache(tiny_student, tiny_teacher, text_file, tmp_path):
    """`heal_distill.kv_dtype`: the same first step on the same data sees another loss (the student's
    cache is rounded, the teacher's is not; on this badly converted toy the FP8 noise may lower it as
    well as raise it), and the run trains and writes a checkpoint."""
    from heal_cases import distill_recipe

    from kvconvert.checkpoint import CheckpointReader
    from kvconvert.recipe import heal

    def first_losses(kv_dtype):
        out = tmp_path / str(kv_dtype)
        rep = heal(tiny_student, tiny_teacher, distill_recipe(text_file, tokens=3 * 2 * 128, kv_dtype=kv_dtype), out,
                   progress=False)
        assert rep["stages"]["heal_distill"]["finished"]
        history = (out / "distill_history.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in history], CheckpointReader(out)

    plain, _ = first_losses(None)
    rounded, healed = first_losses("fp8")
    assert abs(rounded[0] - plain[0]) > 1e-4 * plain[0]
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    assert not torch.equal(healed.get(name), CheckpointReader(tiny_student).get(name))
