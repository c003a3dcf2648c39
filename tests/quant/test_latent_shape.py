"""Latent shaping (kvconvert.quant.latent_shape): the transform's algebra, its effect on real NVFP4
rounding, exactness of the fold on a DeepSeek-V3 whose latent norm is linear, and the refusals."""

from __future__ import annotations

import pytest
import torch
from quant_cases import make_deepseek

from kvconvert.checkpoint import CheckpointReader
from kvconvert.errors import KVConvertError
from kvconvert.heal.options import DistillOptions
from kvconvert.quant.calibrate import CalibrationSettings, calibrate_model, calibrate_streamed
from kvconvert.quant.capture import load_hf_model
from kvconvert.quant.fake_quant import fake_quant, scale_from_amax
from kvconvert.quant.latent_shape import predicted_noise_ratio, shaping_transform
from kvconvert.quant.layout import detect_kv_layout
from kvconvert.quant.options import CalibrateOptions
from kvconvert.recipe import heal_cache_mismatch


def steep_covariance(rank: int = 64, decay: float = 1.0, seed: int = 0) -> torch.Tensor:
    """A covariance with eigenvalues i^-decay in a random basis (a PCA-ordered latent's spectrum)."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(rank, rank, generator=g, dtype=torch.float64))
    vals = torch.arange(1, rank + 1, dtype=torch.float64) ** -decay
    return (basis * vals) @ basis.T


def test_transform_keeps_energy_and_reaches_the_spectral_bound():
    sigma = steep_covariance()
    t = shaping_transform(sigma, 0.25)
    torch.testing.assert_close(torch.trace(t @ sigma @ t.T), torch.trace(sigma))
    lam = torch.linalg.eigvalsh(sigma)
    bound = float(lam.sqrt().sum() ** 2 / (len(lam) * lam.sum()))  # (sum sqrt l)^2 / (r sum l)
    assert predicted_noise_ratio(sigma, t) == pytest.approx(bound, rel=1e-9)
    assert bound < 0.75  # 0.70 for eigenvalues 1/i over 64 values


def test_power_zero_is_an_orthogonal_mix_that_changes_nothing_predicted():
    sigma = steep_covariance()
    t = shaping_transform(sigma, 0.0)
    torch.testing.assert_close(t @ t.T, torch.eye(64, dtype=torch.float64))
    assert predicted_noise_ratio(sigma, t) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8"])
def test_shaping_cuts_real_rounding_error_of_a_steep_latent(kv_dtype):
    """Samples of a steep latent through the real fake quantizer, the error measured after the inverse
    map: shaping must cut it, by about what the spectrum predicts (measured: nvfp4 0.421, fp8 0.432,
    predicted 0.412)."""
    sigma = steep_covariance(64, decay=1.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 64, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(sigma).T
    t = shaping_transform(sigma, 0.25, seed=3)

    def error(stored: torch.Tensor, back: torch.Tensor) -> float:
        s = scale_from_amax(stored.abs().max(), kv_dtype)
        q = fake_quant(stored.float()[None, None], kv_dtype, float(s))[0, 0].double()
        return float(((q - stored) @ back.T).pow(2).sum())

    plain = error(x, torch.eye(64, dtype=torch.float64))
    shaped = error(x @ t.T, torch.linalg.inv(t))
    predicted = predicted_noise_ratio(sigma, t)
    assert shaped / plain < 0.6
    assert shaped / plain == pytest.approx(predicted, rel=0.15)


def linear_norm_deepseek(folder, seed: int = 0):
    """A tiny DeepSeek-V3 whose kv_a_layernorm works in its linear range, as `kvconvert mla` writes it."""
    path = make_deepseek(folder / "raw", seed=seed)
    model = load_hf_model(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.kv_a_proj_with_mqa.weight[:32] *= 1e-4  # mean(c^2)/eps ~ 5e-4
    model.save_pretrained(folder / "linear")
    (folder / "linear" / "tokenizer.json").write_bytes((path / "tokenizer.json").read_bytes())
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).is_file():
            (folder / "linear" / name).write_bytes((path / name).read_bytes())
    return folder / "linear"


def windows(path, tokens=512, window=64):
    from transformers import AutoTokenizer

    from kvconvert.data import calibration_windows

    return calibration_windows(AutoTokenizer.from_pretrained(path), "builtin", tokens, window)


@pytest.mark.parametrize("kv_dtype", ["nvfp4", "nvfp4_fp8rope"])
def test_shaping_keeps_logits_and_the_streamed_path_agrees(tmp_path, kv_dtype):
    path = linear_norm_deepseek(tmp_path)
    reader = CheckpointReader(path)
    layout = detect_kv_layout(reader.config, reader.keys())
    settings = CalibrationSettings(kv_dtype, latent_shaping=0.25)
    ids = windows(path)
    model = load_hf_model(path)
    x = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(input_ids=x).logits
    whole = calibrate_model(model, layout, ids, settings)
    with torch.no_grad():  # the fold is exact up to the norm's linearization (mean(c^2)/(2 eps) ~ 3e-4)
        torch.testing.assert_close(model(input_ids=x).logits, before, rtol=2e-3, atol=2e-4)
    assert whole.plan.value_rotation is None and len(whole.plan.latent_transform) == layout.num_layers
    info = whole.plan.description["latent_shaping"]
    assert info["power"] == 0.25 and info["max_norm_ratio"] < 1e-2 and info["predicted_noise_ratio_mean"] < 1.0
    streamed = calibrate_streamed(reader, layout, ids, settings)
    for a, b in zip(whole.plan.latent_transform, streamed.plan.latent_transform):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(whole.scales.k, streamed.scales.k):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=0.0)


def test_shaping_refused_when_the_latent_norm_is_not_linear(tiny_deepseek):
    reader = CheckpointReader(tiny_deepseek)
    layout = detect_kv_layout(reader.config, reader.keys())
    with pytest.raises(KVConvertError, match="linear range.*--latent-shaping 0"):
        calibrate_streamed(reader, layout, windows(tiny_deepseek), CalibrationSettings("nvfp4", latent_shaping=0.25))


def test_shaping_refused_for_per_head_kv(tiny_llama):
    reader = CheckpointReader(tiny_llama)
    layout = detect_kv_layout(reader.config, reader.keys())
    with pytest.raises(KVConvertError, match="MLA latent"):
        CalibrationSettings("nvfp4", latent_shaping=0.25).check_layout(layout)


def test_quantization_aware_heal_refuses_a_shaped_cache():
    """The QAT heal rounds the latent in the Hadamard basis, not a shaped one: a shaping given is refused, the
    default (which calibrate turns off on such a checkpoint) and an explicit 0 are not."""
    distill = DistillOptions(kv_dtype="nvfp4")
    assert heal_cache_mismatch(distill, CalibrateOptions(kv_dtype="nvfp4")) is None
    assert heal_cache_mismatch(distill, CalibrateOptions(kv_dtype="nvfp4", latent_shaping=0)) is None
    assert "latent_shaping" in heal_cache_mismatch(distill, CalibrateOptions(kv_dtype="nvfp4", latent_shaping=0.25))
    assert "latent_shaping" in heal_cache_mismatch(distill, CalibrateOptions(kv_dtype="nvfp4", value_rotation=False))


def test_default_shapes_a_linear_norm_latent_as_the_explicit_power(tmp_path):
    path = linear_norm_deepseek(tmp_path)
    reader = CheckpointReader(path)
    layout = detect_kv_layout(reader.config, reader.keys())
    ids = windows(path)
    auto = calibrate_streamed(reader, layout, ids, CalibrationSettings("nvfp4_fp8rope"))
    given = calibrate_streamed(reader, layout, ids, CalibrationSettings("nvfp4_fp8rope", latent_shaping=0.25))
    info = auto.plan.description["latent_shaping"]
    assert info["auto"] and info["power"] == 0.25 and "unshaped_layers" not in info
    assert "value_rotation" not in auto.plan.description
    for a, b in zip(auto.plan.latent_transform, given.plan.latent_transform):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_default_keeps_the_unshaped_calibration_where_the_norm_is_not_linear(tiny_deepseek, kv_dtype):
    """tiny_deepseek's latent norm is far from linear: the default shapes no layer, names them all, and
    gives the scales and weights of --latent-shaping 0 (the Hadamard for nvfp4, nothing for fp8)."""
    reader = CheckpointReader(tiny_deepseek)
    layout = detect_kv_layout(reader.config, reader.keys())
    ids = windows(tiny_deepseek)
    auto = calibrate_streamed(reader, layout, ids, CalibrationSettings(kv_dtype))
    off = calibrate_streamed(reader, layout, ids, CalibrationSettings(kv_dtype, latent_shaping=0))
    assert auto.plan.description["latent_shaping"]["unshaped_layers"] == list(range(layout.num_layers))
    for i, transform in enumerate(auto.plan.latent_transform):
        if kv_dtype == "fp8":
            assert transform is None
        else:
            torch.testing.assert_close(transform, off.plan.value_rotation, rtol=0, atol=0)
    for a, b in zip(auto.scales.k, off.scales.k):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0.0)


def test_default_is_off_after_a_quantization_aware_heal(tmp_path):
    """A checkpoint whose manifest says it was healed through a rounded nvfp4 cache keeps the Hadamard the
    heal learned (kvconvert.quant.run.keep_heal_basis), and the report says why."""
    import json

    from kvconvert.quant.run import CalibrateJob, run_calibrate

    path = linear_norm_deepseek(tmp_path)
    (path / "manifest.json").write_text(json.dumps({"kvconvert_heal": {"recipe": {"heal_distill": {"kv_dtype": "nvfp4"}}}}))
    opts = CalibrateOptions(kv_dtype="nvfp4", calib_tokens=512, window_len=64, search_tokens=0)
    report = run_calibrate(CalibrateJob(src=str(path), options=opts, out=tmp_path / "out"), echo=lambda m: None)["report"]
    rotation = report["rotation"]
    assert "healed through a rounded nvfp4 cache" in rotation["latent_shaping"]["auto"]
    assert rotation["value_rotation"].startswith("hadamard")
