"""KV scales folded into the weights (kvconvert/quant/fold.py): full-precision logits unchanged; the
remaining scale on the folded model quantizes exactly like the calibrated scale on the original; an
engine at scale 1.0 on the folded model is as good as the calibrated scale (within noise)."""

from __future__ import annotations

import pytest
import torch
from quant_cases import make_deepseek, make_llama

from kvconvert.quant.calibrate import observe_kv
from kvconvert.quant.capture import forward_with_hook, load_hf_model
from kvconvert.quant.fake_quant import scale_from_amax
from kvconvert.quant.fold import fold_factor, fold_layer, fold_plan, tied_candidates
from kvconvert.quant.hooks import fake_quant_hook, identity_hook
from kvconvert.quant.layout import checkpoint_kv_layout, detect_kv_layout
from kvconvert.quant.scales import KVScales

IDS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(3))


def _fold_model(model, layout, factors) -> None:
    with torch.no_grad():
        for layer, (fk, fv) in zip(model.model.layers, factors):
            params = dict(layer.self_attn.named_parameters())
            for name, t in fold_layer({n: p.detach() for n, p in params.items()}, layout, fk, fv).items():
                params[name].copy_(t)


def _random_scales(layout, kv_dtype="fp8", seed=0) -> KVScales:
    g = torch.Generator().manual_seed(seed)
    n = layout.num_layers
    k = [2.0 ** (torch.rand((), generator=g) * 16 - 12) for _ in range(n)]  # 2^-12 .. 2^4
    v = k if layout.is_mla else [2.0 ** (torch.rand((), generator=g) * 16 - 12) for _ in range(n)]
    return KVScales(kv_dtype, "tensor", layout.kind, k, v)


def _amax_scales(model, layout, kv_dtype) -> KVScales:
    observers = observe_kv(model, layout, IDS, batch_size=IDS.shape[0])
    per = [[scale_from_amax(obs[kind].amax_tensor, kv_dtype) for obs in observers] for kind in layout.cached_names]
    return KVScales(kv_dtype, "tensor", layout.kind, per[0], per[-1])  # MLA: the row scale as k and v


def _kl(ref_logits, logits) -> float:
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


CASES = [
    pytest.param(lambda p: make_llama(p, seed=1), id="llama"),
    pytest.param(lambda p: make_llama(p, seed=2, bias=True), id="llama-bias"),
    pytest.param(lambda p: make_deepseek(p, seed=3), id="deepseek"),
    pytest.param(lambda p: make_deepseek(p, seed=4, rope_interleave=False), id="deepseek-neox"),
]


def test_fold_factor_is_the_next_power_of_two():
    assert fold_factor(torch.tensor(0.3)) == 0.5
    assert fold_factor(torch.tensor(0.25)) == 0.25
    assert fold_factor(torch.tensor([0.01, 3.0])) == 4.0
    _, remaining = fold_plan(KVScales("fp8", "head", "GQA", [torch.tensor([0.01, 3.0])], [torch.tensor([5e-4, 6e-4])]))
    assert torch.equal(remaining.k[0], torch.tensor([0.01 / 4, 0.75]))
    assert float(remaining.v[0].max()) <= 1.0 and float(remaining.v[0].max()) > 0.5


def test_tied_candidates_fold_to_one_written_scale():
    """For an engine that stores K and V at one scale (int8): every candidate pair is a power of two apart, keeps
    one of the two scales and moves the other by less than 2x, and folds to equal written scales (bit for bit)."""
    g = torch.Generator().manual_seed(5)
    for _ in range(50):
        k, v = (2.0 ** (torch.rand((), generator=g) * 16 - 12) for _ in range(2))
        candidates = tied_candidates(k, v)
        assert len(candidates) == 4 and [float(a * b) for a, b in candidates] == sorted(float(a * b) for a, b in candidates)
        for ck, cv in candidates:
            assert torch.equal(ck, k) or torch.equal(cv, v)
            assert 0.5 < float(ck / k) * float(cv / v) < 2
            _, remaining = fold_plan(KVScales("int8", "tensor", "GQA", [ck], [cv]))
            assert torch.equal(remaining.k[0], remaining.v[0])
    assert [(float(a), float(b)) for a, b in tied_candidates(torch.tensor(0.5), torch.tensor(0.125))] == [(0.5, 0.125)]
    with pytest.raises(ValueError, match="per-tensor"):
        tied_candidates(torch.ones(2), torch.ones(2))


@pytest.mark.parametrize("make", CASES)
def test_folding_keeps_full_precision_logits(make, tmp_path):
    path = make(tmp_path / "m")
    model, layout = load_hf_model(path), checkpoint_kv_layout(path)
    before = forward_with_hook(model, IDS, identity_hook)
    factors, _ = fold_plan(_random_scales(layout))
    assert any(f != 1.0 for pair in factors for f in pair)
    k_before = {n: t.clone() for n, t in model.model.layers[0].self_attn.state_dict().items()}
    _fold_model(model, layout, factors)
    assert any(not torch.equal(k_before[n], t) for n, t in model.model.layers[0].self_attn.state_dict().items())
    torch.testing.assert_close(forward_with_hook(model, IDS, identity_hook), before, rtol=1e-5, atol=1e-5)


def test_folding_is_exact_in_bf16():
    w = torch.randn(64, 32).to(torch.bfloat16)
    layout = detect_kv_layout({"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                               "hidden_size": 32, "head_dim": 16},
                              [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")])
    local = {"q_proj.weight": w[:32], "k_proj.weight": w[32:], "v_proj.weight": w[32:], "o_proj.weight": w[:32]}
    folded = fold_layer(local, layout, 2.0 ** -9, 2.0 ** 5)
    assert folded["k_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(folded["k_proj.weight"] * 2.0 ** -9, local["k_proj.weight"])  # only exponents moved
    assert torch.equal(folded["o_proj.weight"] / 2.0 ** 5, local["o_proj.weight"])


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4", "int8"])
@pytest.mark.parametrize("make", CASES)
def test_remaining_scale_on_folded_model_quantizes_like_the_calibrated_one(make, kv_dtype, tmp_path):
    path = make(tmp_path / "m")
    model, layout = load_hf_model(path), checkpoint_kv_layout(path)
    scales = _amax_scales(model, layout, kv_dtype)
    calibrated = forward_with_hook(model, IDS, fake_quant_hook(layout, scales))
    factors, remaining = fold_plan(scales)
    _fold_model(model, layout, factors)
    torch.testing.assert_close(forward_with_hook(model, IDS, fake_quant_hook(layout, remaining)), calibrated,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", CASES)
def test_an_engine_at_scale_one_on_the_folded_model_matches_the_calibrated_scale(make, tmp_path):
    """The cache is made small (x 2^-14, compensated in the readers: an equivalent model) so that an
    engine storing it at scale 1.0 loses it to FP8's subnormal range, as vLLM does with MLA today."""
    path = make(tmp_path / "m")
    model, layout = load_hf_model(path), checkpoint_kv_layout(path)
    _fold_model(model, layout, [(2.0 ** 14, 2.0 ** 14)] * layout.num_layers)  # an equivalent tiny-cache model
    ref = forward_with_hook(model, IDS, identity_hook)
    scales = _amax_scales(model, layout, "fp8")
    ones = KVScales("fp8", "tensor", layout.kind, [torch.tensor(1.0)] * layout.num_layers,
                    [torch.tensor(1.0)] * layout.num_layers)
    kl_calibrated = _kl(ref, forward_with_hook(model, IDS, fake_quant_hook(layout, scales)))
    kl_unfolded_at_one = _kl(ref, forward_with_hook(model, IDS, fake_quant_hook(layout, ones)))
    factors, _ = fold_plan(scales)
    _fold_model(model, layout, factors)
    kl_folded_at_one = _kl(ref, forward_with_hook(model, IDS, fake_quant_hook(layout, ones)))
    assert kl_unfolded_at_one > 20 * kl_calibrated  # the failure folding exists to prevent
    assert kl_folded_at_one == pytest.approx(kl_calibrated, rel=0.5)
