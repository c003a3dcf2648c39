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


def test_refuses_what_the_cache_cannot_hold():
    """An MLA-only layout for per-head K/V, and llama.cpp's blocks of 32 across rows of 16, by name."""
    from kvconvert.errors import KVConvertError
    from kvconvert.kvmath import GQA, KVShape

    llama = KVShape(GQA, 2, 4, num_kv_heads=2, head_dim=16)
    with pytest.raises(KVConvertError, match="per-head K and V"):
        quant_aware.quant_aware_hook(torch.nn.Module(), llama, "nvfp4_fp8rope")
    with pytest.raises(KVConvertError, match="blocks of 32 values, which do not divide the 16 values"):
        quant_aware.quant_aware_hook(torch.nn.Module(), llama, "q4_0")


@pytest.fixture(scope="module")
def llama64(tmp_path_factory) -> Path:
    """head_dim 64: llama.cpp turns K (and V) by its Hadamard before its 4-bit blocks."""
    from quant_cases import make_llama

    return make_llama(tmp_path_factory.mktemp("qat") / "llama64", head_dim=64)


@pytest.fixture(scope="module")
def llama64_one_layer(tmp_path_factory) -> Path:
    """As `one_layer`: calibration's amax and the hook's agree only in the first layer."""
    from quant_cases import make_llama

    return make_llama(tmp_path_factory.mktemp("qat") / "llama64-1", head_dim=64, layers=1)


@pytest.fixture(scope="module")
def mla32(llama64, text_file, tmp_path_factory) -> Path:
    """A real conversion llama.cpp serves in its block types: latent 32 and k_rope 32, a block each."""
    from heal_cases import convert_tiny

    return convert_tiny(llama64, tmp_path_factory.mktemp("qat") / "mla32", text_file, rank=32, rope_dim=32)


@pytest.mark.parametrize("kv_dtype", ["q4_0", "iq4_nl", "q8_0"])
@pytest.mark.parametrize("student", ["llama64", "mla32"])
def test_training_forward_reads_llamacpps_cache(student, kv_dtype, request):
    """The hooked training forward reads the cache exactly as the runtime's llama.cpp emulation stores it (its
    Hadamard and channel order for per-head K/V, the MLA row whole and unrotated): equal to fp32 rounding, a
    millionth of the rounding's own effect. With the rotation left out (a mutation), far from it."""
    from kvconvert.quant.hooks import llamacpp_hook

    folder = request.getfixturevalue(student)
    model = load_hf_model(folder)
    layout = kv_shape(model.config.to_dict())
    ids = IDS % model.config.vocab_size
    engine = forward_with_hook(model, ids, llamacpp_hook(layout, kv_dtype))
    with torch.no_grad():
        exact = model(input_ids=ids).logits
        attach_cache_rounding(model, layout, kv_dtype)
        trained = model(input_ids=ids).logits
    effect = (engine - exact).abs().max()
    assert effect > 1e-3
    assert (trained - engine).abs().max() <= 1e-5 * effect + 1e-6, (float((trained - engine).abs().max()), float(effect))
    if student == "llama64":
        unrotated = forward_with_hook(load_hf_model(folder), ids, llamacpp_hook(layout, kv_dtype, rotate=False))
        assert (unrotated - engine).abs().max() > 0.05 * effect


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8", "nvfp4"])
def test_per_head_training_forward_reads_the_calibrated_cache(llama64_one_layer, kv_dtype, monkeypatch):
    """A per-head student in a scaled format: the training forward equals the calibrated model (amax scales on
    the same windows, no phases or pair balance, which the hook does not emulate) with its cache fake-quantized,
    nvfp4's folded value Hadamard included."""
    from kvconvert.quant.calibrate import CalibrationSettings, calibrate_model
    from kvconvert.quant.hooks import fake_quant_hook

    model = load_hf_model(llama64_one_layer)
    layout = kv_shape(model.config.to_dict())
    exact = forward_with_hook(model, IDS, lambda layer, k, v: (k, v))
    result = calibrate_model(model, layout, IDS, CalibrationSettings(kv_dtype, observer="amax", key_phase=False,
                                                                     key_balance=0.0, batch_size=2))
    engine = forward_with_hook(model, IDS, fake_quant_hook(layout, result.scales))
    effect = (engine - exact).abs().max()
    assert effect > 1e-3
    gap = (_training_logits(llama64_one_layer, kv_dtype) - engine).abs().max()
    assert gap <= 1e-4 * effect + 1e-5, (float(gap), float(effect))
    if kv_dtype == "nvfp4":  # without V's Hadamard (a mutation) the training forward reads another cache
        monkeypatch.setattr(quant_aware, "latent_rotation", lambda layout, kv_dtype: None)
        assert (_training_logits(llama64_one_layer, kv_dtype) - engine).abs().max() > 0.1 * effect


def test_gradient_goes_straight_through_llamacpps_rounding(llama64):
    """d loss / d k_proj through a q4_0 cache: the rounding's own gradient is zero almost everywhere; the
    straight-through one is that of the rounded forward with the rounding taken as identity (non-zero)."""
    model = load_hf_model(llama64)
    model.train()
    attach_cache_rounding(model, kv_shape(model.config.to_dict()), "q4_0")
    model(input_ids=IDS, labels=IDS).loss.backward()
    grad = model.model.layers[0].self_attn.k_proj.weight.grad
    assert grad is not None and float(grad.abs().max()) > 0


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


def test_a_source_heals_for_its_llamacpp_cache(llama64, text_file, tmp_path):
    """`heal --student SRC --teacher SRC --distill-kv-dtype q4_0`: with an exact cache the student is the teacher
    (first KL 0); with llama.cpp's rounding it is not, and a few steps of attention-only training lower the KL
    the rounded cache costs on windows it did not train on, leaving the MLP as it was."""
    from heal_cases import distill_recipe

    from kvconvert.checkpoint import CheckpointReader, load_tokenizer
    from kvconvert.data import eval_windows
    from kvconvert.heal.token_plan import window_kls
    from kvconvert.recipe import heal

    def run(kv_dtype, steps):
        out = tmp_path / str(kv_dtype)
        heal(llama64, llama64, distill_recipe(text_file, tokens=steps * 2 * 128, kv_dtype=kv_dtype, lr=0.002,
                                              warmup_steps=0), out, progress=False)
        return [json.loads(line)["loss"] for line in (out / "distill_history.jsonl").read_text().splitlines()], out

    plain, _ = run(None, 1)
    assert plain[0] < 1e-6
    rounded, healed = run("q4_0", 8)
    assert rounded[0] > 1e-5 and rounded[0] > 100 * plain[0]
    ids = eval_windows(load_tokenizer(llama64), 4, 128, "essays")
    teacher = load_hf_model(llama64)
    before, after = window_kls(teacher, llama64, ids, "q4_0"), window_kls(teacher, healed, ids, "q4_0")
    assert after.mean() < 0.9 * before.mean(), (after.mean(), before.mean())
    reader, source = CheckpointReader(healed), CheckpointReader(llama64)
    assert not torch.equal(reader.get("model.layers.0.self_attn.k_proj.weight"),
                           source.get("model.layers.0.self_attn.k_proj.weight"))
    assert torch.equal(reader.get("model.layers.0.mlp.up_proj.weight"), source.get("model.layers.0.mlp.up_proj.weight"))


def test_a_format_the_student_cannot_hold_is_refused_before_any_stage(tiny_student, tiny_teacher, text_file, tmp_path):
    """q4_0 for a row of 16 values (rank 8 + rope 8): refused by name (llama.cpp's shape rule) before the layer-wise
    stage runs."""
    from heal_cases import distill_recipe, layerwise_recipe

    from kvconvert.errors import KVConvertError
    from kvconvert.heal.api import state_dir_for
    from kvconvert.recipe import heal

    recipe = {**layerwise_recipe(text_file), **distill_recipe(text_file, kv_dtype="q4_0")}
    with pytest.raises(KVConvertError, match="heal_distill.kv_dtype: .*blocks of 32 values, which do not divide the 16 "):
        heal(tiny_student, tiny_teacher, recipe, tmp_path / "out", progress=False)
    assert not state_dir_for(tmp_path / "out").exists()  # nothing ran


def test_a_kv_pair_rounds_keys_and_values_apart(llama64, mla32):
    """q5_0/iq4_nl: K in q5_0 and V in iq4_nl, as the runtime's llama.cpp emulation stores them (-ctk / -ctv), and
    not as either format for both; an MLA row has no V half and the pair is refused for it by name."""
    from kvconvert.errors import KVConvertError
    from kvconvert.quant.hooks import llamacpp_hook

    model = load_hf_model(llama64)
    layout = kv_shape(model.config.to_dict())
    engine = {kv: forward_with_hook(model, IDS, llamacpp_hook(layout, kv))
              for kv in ("q5_0/iq4_nl", "q5_0", "iq4_nl")}
    with torch.no_grad():
        attach_cache_rounding(model, layout, "q5_0/iq4_nl")
        trained = model(input_ids=IDS).logits
    gap = (trained - engine["q5_0/iq4_nl"]).abs().max()
    assert gap <= 1e-6 + 1e-5 * (trained - engine["q5_0"]).abs().max()
    assert (trained - engine["q5_0"]).abs().max() > 100 * gap and (trained - engine["iq4_nl"]).abs().max() > 100 * gap
    mla = load_hf_model(mla32)
    with pytest.raises(KVConvertError, match="no V half"):
        attach_cache_rounding(mla, kv_shape(mla.config.to_dict()), "q5_0/iq4_nl")


@pytest.mark.parametrize("kv_dtype", ["q4_0", "iq4_nl"])
def test_an_mla_conversion_heals_for_llamacpps_cache(mla32, llama64, text_file, tmp_path, kv_dtype):
    """`heal --student MLA --teacher SRC --distill-kv-dtype q4_0` (once a TypeError in the scaled formats' scale
    rule): the row goes through llama.cpp's blocks, the run trains and writes the checkpoint."""
    from heal_cases import distill_recipe

    from kvconvert.checkpoint import CheckpointReader
    from kvconvert.recipe import heal

    out = tmp_path / "healed"
    rep = heal(mla32, llama64, distill_recipe(text_file, tokens=2 * 2 * 128, kv_dtype=kv_dtype), out,
               progress=False)
    assert rep["stages"]["heal_distill"]["finished"]
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert not torch.equal(CheckpointReader(out).get(name), CheckpointReader(mla32).get(name))
