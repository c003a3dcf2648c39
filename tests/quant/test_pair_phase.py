"""Key pair phases: the closed form is the grid optimum of the rounding-noise objective, the RoPE pair
statistics match what the model really computes, and the folded phases do what they predict."""

import math

import pytest
import torch
from quant_cases import make_deepseek

from kvconvert.quant.calibrate import CalibrationSettings, calibrate_model, observe_pair_moments, plan_rotation
from kvconvert.quant.capture import AttentionRecorder, load_hf_model, run_with_hook
from kvconvert.quant.layout import checkpoint_kv_layout
from kvconvert.quant.pair_stats import complex_pairs, post_rope_pairs
from kvconvert.quant.rotate import RotationPlan, apply_plan_to_model, pair_noise, pair_phase


def rounding_noise(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mean over all (query, key) sample combinations of q_x^2 k_x^2 + q_y^2 k_y^2: the score noise
    of one pair under unit relative rounding of the stored key. q: [Nq] complex, k: [Nk] complex."""
    prod_x = q.real[:, None] * k.real[None, :]
    prod_y = q.imag[:, None] * k.imag[None, :]
    return (prod_x.square() + prod_y.square()).mean()


@pytest.mark.parametrize("seed", range(4))
def test_pair_phase_is_the_grid_optimum_and_pair_noise_is_exact(seed):
    g = torch.Generator().manual_seed(seed)
    # queries and keys with a preferred phase (a slow RoPE pair) plus spread
    q = torch.polar(1 + torch.rand(200, generator=g, dtype=torch.float64),
                    2 * torch.rand(1, generator=g, dtype=torch.float64) + 0.4 * torch.randn(200, generator=g, dtype=torch.float64))
    k = torch.polar(1 + 3 * torch.rand(300, generator=g, dtype=torch.float64),
                    6 * torch.rand(1, generator=g, dtype=torch.float64) + 0.6 * torch.randn(300, generator=g, dtype=torch.float64))
    moments = ((q * q).mean(), (k * k).mean(), (q.abs() ** 2).mean(), (k.abs() ** 2).mean())
    best = pair_phase(moments[0], moments[1])
    assert best.abs().item() == pytest.approx(1.0)
    grid = torch.polar(torch.ones(720, dtype=torch.float64), torch.arange(720, dtype=torch.float64) * math.pi / 720)
    grid_noise = torch.stack([rounding_noise(z * q, z * k) for z in grid])
    closed = rounding_noise(best * q, best * k)
    assert closed <= grid_noise.min() * (1 + 1e-9)
    # the moment formula is exact for the all-pairs mean, before and after the phase
    assert pair_noise(*moments).item() == pytest.approx(rounding_noise(q, k).item(), rel=1e-10)
    assert pair_noise(*moments, factor=best).item() == pytest.approx(closed.item(), rel=1e-10)
    assert closed < 0.9 * rounding_noise(q, k)  # a preferred phase leaves something to gain


def first_attention_call(path):
    layout, model = checkpoint_kv_layout(path), load_hf_model(path)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    recorder = AttentionRecorder(model)
    recorder.active = True
    cached = {}

    def hook(layer, key, value):
        cached.setdefault(layer, (key, value))
        return key, value
    run_with_hook(model, ids, hook, batch_size=2)
    recorder.remove()
    return layout, model, recorder.records[1][0], cached[1]


def model_path(kind: str, tiny_llama, tmp_path):
    return tiny_llama if kind == "llama" else make_deepseek(tmp_path / "d", rope_interleave=kind.endswith("interleave"))


@pytest.mark.parametrize("kind", ["llama", "deepseek-interleave", "deepseek-half"])
def test_post_rope_pairs_match_the_cache_and_transformers(kind, tiny_llama, tmp_path):
    """The key pairs are exactly what the cache stores (MLA: transformers caches k_rope de-interleaved,
    pairs (i, i + r/2), whatever rope_interleave says); the Llama queries are what transformers rotates."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layout, model, rec, (cached_k, cached_k_rope) = first_attention_call(model_path(kind, tiny_llama, tmp_path))
    attn, h = model.model.layers[1].self_attn, rec["hidden_states"]
    with torch.no_grad():
        q, k = post_rope_pairs(attn, layout, h, rec["position_embeddings"])
        q_ref = attn.q_proj(h).view(*h.shape[:2], -1, layout.head_dim).transpose(1, 2) if not layout.is_mla else None
    cached = cached_k_rope if layout.is_mla else cached_k  # MLA caches (latent, k_rope)
    torch.testing.assert_close(k, complex_pairs(cached.transpose(1, 2), False), rtol=1e-6, atol=1e-6)
    if q_ref is not None:
        q_ref, _ = apply_rotary_pos_emb(q_ref, q_ref, *rec["position_embeddings"])
        torch.testing.assert_close(q, complex_pairs(q_ref.transpose(1, 2), False), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "deepseek-interleave", "deepseek-half"])
def test_folded_phases_reach_the_optimum_and_keep_logits(kind, tiny_llama, tmp_path):
    """After folding, the measured moments sit at the optimum (arg E[q^2] E[k^2] = pi): this checks that
    the queries and keys of the real model were rotated consistently; the logits must not move."""
    path = model_path(kind, tiny_llama, tmp_path)
    layout, model = checkpoint_kv_layout(path), load_hf_model(path)
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    plan = plan_rotation(model, layout, CalibrationSettings("fp8"), ids)
    assert plan.value_rotation is None and plan.key_pair_factor is not None
    apply_plan_to_model(model, plan)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
    for m in observe_pair_moments(model, layout, ids, batch_size=2):
        z = m.q_moment * m.k_moment
        live = z.abs() > 1e-6 * z.abs().max()
        angle = torch.angle(z[live]).abs()
        torch.testing.assert_close(angle, torch.full_like(angle, math.pi), rtol=0, atol=1e-4)  # fp32 model


def test_phases_skip_the_unquantized_mla_rope_key_under_nvfp4(tiny_deepseek):
    layout = checkpoint_kv_layout(tiny_deepseek)
    assert not CalibrationSettings("nvfp4").key_phase_enabled(layout)
    assert CalibrationSettings("fp8").key_phase_enabled(layout)
    assert not CalibrationSettings("fp8", rotate=False).rotation_enabled


@pytest.mark.slow
def test_phases_cut_fp8_key_noise_on_smollm2(smollm2_path):
    """On the real model the folded phases lower the FP8 error of the cached keys as seen by the scores:
    measured as the attention-output error of every layer with only K fake-quantized (amax scales)."""
    from transformers import AutoTokenizer

    from kvconvert.data import calibration_windows
    from kvconvert.quant.fake_quant import fake_quant

    layout = checkpoint_kv_layout(smollm2_path)
    windows = calibration_windows(AutoTokenizer.from_pretrained(smollm2_path), "builtin", 1024, 256)

    def key_only_error(model):
        recorder = AttentionRecorder(model)
        recorder.active = True
        run_with_hook(model, windows[:2], lambda i, k, v: (k, v), batch_size=2)
        recorder.active = False
        total = 0.0
        for layer in range(layout.num_layers):
            keys = []
            recorder.replay(layer, lambda i, k, v: (keys.append(k) or k, v))
            scale = keys[0].abs().max() / 448

            def quant_k(i, k, v):
                return fake_quant(k, "fp8", scale), v
            exact = recorder.replay(layer, lambda i, k, v: (k, v))
            quant = recorder.replay(layer, quant_k)
            total += sum(float((a - b).double().square().sum() / b.double().square().sum()) for a, b in zip(quant, exact))
        recorder.remove()
        return total

    plain = load_hf_model(smollm2_path)
    base = key_only_error(plain)
    phased = load_hf_model(smollm2_path)
    settings = CalibrationSettings("fp8", observer="amax")
    result = calibrate_model(phased, layout, windows, settings)
    assert isinstance(result.plan, RotationPlan) and result.plan.key_pair_factor is not None
    predicted = result.plan.description["key_pair_phase"]["predicted_noise_ratio_mean"]
    measured = key_only_error(phased) / base
    assert predicted < 0.9 and measured < 0.9, (predicted, measured)
