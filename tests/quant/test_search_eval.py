"""MSE scale search (fast replay == real module) and the fake-quant perplexity/KL evaluation."""

import math

import pytest
import torch

from kvconvert.eval.kv_quant import evaluate_kv_quant
from kvconvert.quant.calibrate import observe_kv
from kvconvert.quant.capture import AttentionRecorder, load_hf_model
from kvconvert.quant.fake_quant import scale_from_amax
from kvconvert.quant.hooks import fake_quant_hook, identity_hook
from kvconvert.quant.layout import checkpoint_kv_layout
from kvconvert.quant.scales import KVScales
from kvconvert.quant.search import LayerReplay, search_replay_scales


def setup(path, n=2, t=32, seed=0):
    layout, model = checkpoint_kv_layout(path), load_hf_model(path)
    ids = torch.randint(0, 512, (n, t), generator=torch.Generator().manual_seed(seed))
    recorder = AttentionRecorder(model)
    observers = observe_kv(model, layout, ids, batch_size=1, recorder=recorder, record_windows=n)
    return layout, model, ids, recorder, observers


@pytest.mark.parametrize("kind,kv_dtype", [("llama", "nvfp4"), ("deepseek", "nvfp4"), ("deepseek", "nvfp4_fp8rope")])
def test_fast_replay_matches_module_replay(kind, kv_dtype, tiny_llama, tiny_deepseek):
    """The search's replay quantizes what the engine stores: under NVFP4 the MLA k_rope is kept apart
    (16-bit, or FP8 for nvfp4_fp8rope), as fake_quant_hook and the runtime store it."""
    path = tiny_llama if kind == "llama" else tiny_deepseek
    layout, _, _, recorder, observers = setup(path)
    layer = 1
    scales = {k: scale_from_amax(torch.tensor(o.amax_tensor), kv_dtype).float() * 0.7 for k, o in observers[layer].items()}
    replay = LayerReplay(recorder, layout, layer, kv_dtype)
    assert replay.errors({k: None for k in scales}, full=True)[0] == 0.0
    k, v = scales.get("kv", scales.get("k")), scales.get("kv", scales.get("v"))  # MLA: one row scale
    kv_scales = KVScales(kv_dtype, "tensor", layout.kind, [k] * (layer + 1), [v] * (layer + 1))

    slow = recorder.replay(layer, fake_quant_hook(layout, kv_scales))
    ref = recorder.replay(layer, lambda i, k, v: (k, v))
    expected = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(slow, ref))
    assert replay.errors(scales, full=True)[0] == pytest.approx(expected, rel=1e-3)
    recorder.remove()


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_search_never_worse_than_amax(tiny_llama, granularity):
    layout, _, _, recorder, observers = setup(tiny_llama)
    amax = {k: scale_from_amax(o.statistic("amax", granularity), "fp8").float() for k, o in observers[1].items()}
    scales, info = search_replay_scales(LayerReplay(recorder, layout, 1, "fp8"), layout, "fp8", amax)
    assert info["rel_error_search"] <= info["rel_error_amax"]
    assert scales["k"].shape == amax["k"].shape
    recorder.remove()


def test_evaluate_matches_manual_cross_entropy_and_identity_has_zero_kl(tiny_llama):
    layout, model, ids, recorder, _ = setup(tiny_llama, n=2, t=24)
    recorder.remove()
    tiny = KVScales("nvfp4", "tensor", layout.kind, [torch.tensor(1e-3)] * 2, [torch.tensor(1e-3)] * 2)
    res = evaluate_kv_quant(model, {"same": (model, identity_hook), "coarse": (model, fake_quant_hook(layout, tiny))}, ids)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert res["reference"].ppl == pytest.approx(math.exp(float(ce)), rel=1e-5)
    assert res["same"].ppl == pytest.approx(res["reference"].ppl, rel=1e-6)
    assert abs(res["same"].kl) < 1e-6
    assert res["coarse"].kl > 1e-4 and res["reference"].tokens == 2 * 23



@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_search_replays_each_distinct_trial_once(tiny_llama, granularity):
    """The fine grid's offset 0 repeats the coarse best, and the coarse offset 0 is the start (amax rounded up to
    the grid): both are taken from trials already replayed (a trial is a pure function of its scales). fp8, K
    then V: 9 coarse + 7 fine trials per kind, less those repeats, plus the start and the final check."""
    layout, _, _, recorder, observers = setup(tiny_llama)
    amax = {k: scale_from_amax(o.statistic("amax", granularity), "fp8").float() for k, o in observers[1].items()}
    replay = LayerReplay(recorder, layout, 1, "fp8")
    seen, original = [], replay.errors

    def counting(scales, full=False):
        seen.append((full, tuple(None if s is None else s.numpy().tobytes() for s in scales.values())))
        return original(scales, full)

    replay.errors = counting
    scales, info = search_replay_scales(replay, layout, "fp8", amax)
    trials = [key for full, key in seen if not full]
    assert len(trials) == len(set(trials)) and seen[0][1] not in trials  # no trial replayed twice, nor the start
    assert [full for full, _ in seen].count(True) == 2  # the amax start and the final check (with cross terms)
    # repeats: K's offset 0 (the start) and, per tensor, each fine offset 0 (per head the fine trials mix the
    # heads' bests, which no coarse trial did); V's offset 0 is the start again when K kept its start
    fine_repeat = 1 if granularity == "tensor" else 0
    assert len(seen) <= 1 + (9 + 7 - 1 - fine_repeat) + (9 + 7 - fine_repeat) + 1
    assert info["rel_error_search"] <= info["rel_error_amax"]
    recorder.remove()


def test_searched_scales_lie_on_the_grid_and_ties_go_to_the_larger_scale(tiny_llama):
    """Every scale the search returns is exactly 2^(n/16), the start amax rounded up to it (so amax differing in
    its last bits, as fp32 forwards on two CPUs give, leads to the same candidates and the same bits): an amax
    one ulp away gives the same scales, and errors within TIE_RTOL of the smallest tie to the last (largest)
    candidate."""
    from kvconvert.quant.search import GRID, TIE_RTOL, argmin_prefer_last, grid_index, grid_scale

    layout, _, _, recorder, observers = setup(tiny_llama)
    amax = {k: scale_from_amax(o.statistic("amax", "tensor"), "fp8").float() for k, o in observers[1].items()}
    scales, info = search_replay_scales(LayerReplay(recorder, layout, 1, "fp8"), layout, "fp8", amax)
    for s in scales.values():  # the fallback too: the start is on the grid
        assert torch.equal(grid_scale(grid_index(s)), s)
        assert abs(math.log2(float(s)) * GRID - int(grid_index(s))) < 1e-5
    nudged = {k: torch.nextafter(a, torch.tensor(float("inf"))) for k, a in amax.items()}  # one ulp up
    again, _ = search_replay_scales(LayerReplay(recorder, layout, 1, "fp8"), layout, "fp8", nudged)
    assert all(torch.equal(again[k], scales[k]) for k in scales)
    recorder.remove()
    on_grid = grid_scale(torch.tensor([-70, 0, 33]))
    assert grid_index(on_grid, up=True).tolist() == [-70, 0, 33]  # a scale on the grid stays where it is
    assert grid_index(on_grid * 1.001, up=True).tolist() == [-69, 1, 34]
    assert argmin_prefer_last(torch.tensor([2.0, 1.0, 1.0 + 0.5 * TIE_RTOL, 3.0])) == 2
    assert argmin_prefer_last(torch.tensor([2.0, 1.0, 1.0 + 2 * TIE_RTOL, 3.0])) == 1
