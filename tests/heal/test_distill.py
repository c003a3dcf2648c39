"""Distillation on a tiny model: KL goes down, interrupted + resumed == uninterrupted."""

import json

import torch

from kvconvert.checkpoint import CheckpointReader
from kvconvert.heal.api import state_dir_for
from kvconvert.recipe import heal

from heal_cases import distill_recipe


def _eval_kl(teacher, student, text_file):
    from transformers import AutoTokenizer

    from kvconvert.data import token_windows
    from kvconvert.heal.evaluate import window_metrics
    from kvconvert.quant.capture import load_hf_model

    tok = AutoTokenizer.from_pretrained(str(teacher))
    ids = token_windows(tok, text_file.read_text()[-20000:], 4, 128)  # not in the training windows
    return window_metrics(load_hf_model(teacher), {"c": load_hf_model(student)}, ids)["c"]["kl_mean"]


def test_distill_reduces_kl_and_resumes(tiny_student, tiny_teacher, text_file, tmp_path):
    recipe = distill_recipe(text_file)
    full = tmp_path / "full"
    rep = heal(tiny_student, tiny_teacher, recipe, full, progress=False)
    d = rep["stages"]["heal_distill"]
    assert d["finished"] and d["steps_done"] == 12 and d["tokens"] == 12 * 2 * 128
    assert (full / "loss_curve.png").stat().st_size > 1000
    assert len((full / "distill_history.jsonl").read_text().splitlines()) == 12
    assert _eval_kl(tiny_teacher, full, text_file) < 0.95 * _eval_kl(tiny_teacher, tiny_student, text_file)

    # interrupted after 5 steps (state saved in the output's temp area), then resumed
    part = tmp_path / "part"
    rep = heal(tiny_student, tiny_teacher, recipe, part, progress=False, max_steps=5)
    assert rep["finished"] is False and not part.exists()
    assert (state_dir_for(part) / "distill" / "distill_state.pt").is_file()
    rep = heal(tiny_student, tiny_teacher, recipe, part, progress=False)
    assert rep["stages"]["heal_distill"]["resumed_at_step"] == 5 and rep["finished"]
    assert not state_dir_for(part).exists()
    a, b = CheckpointReader(full), CheckpointReader(part)
    for name in a.keys():
        assert torch.allclose(a.get(name), b.get(name), rtol=0, atol=1e-6), name
    hist_a = [json.loads(x)["loss"] for x in (full / "distill_history.jsonl").read_text().splitlines()]
    hist_b = [json.loads(x)["loss"] for x in (part / "distill_history.jsonl").read_text().splitlines()]
    assert hist_a == hist_b


def test_lora_distill_merges(tiny_student, tiny_teacher, text_file, tmp_path):
    from transformers import DeepseekV3ForCausalLM

    out = tmp_path / "lora"
    heal(tiny_student, tiny_teacher, distill_recipe(text_file, train="lora", lora_rank=2, tokens=3 * 2 * 128,
                                                    targets=["q_proj", "o_proj"]), out, progress=False)
    s, h = CheckpointReader(tiny_student), CheckpointReader(out)
    q0, q1 = s.get("model.layers.0.self_attn.q_proj.weight"), h.get("model.layers.0.self_attn.q_proj.weight")
    assert not torch.equal(q0, q1) and torch.linalg.matrix_rank(q1 - q0) <= 2  # merged low-rank delta
    assert torch.equal(s.get("model.layers.0.self_attn.kv_b_proj.weight"), h.get("model.layers.0.self_attn.kv_b_proj.weight"))
    DeepseekV3ForCausalLM.from_pretrained(str(out))


def test_hidden_state_loss_reference():
    from kvconvert.heal.distill import hidden_state_loss

    torch.manual_seed(0)
    t = [torch.randn(1, 4, 8) for _ in range(3)]
    s = [t[0], t[1] + 0.1, t[2] * 2]
    ref = ((0.1 ** 2 * 32) / t[1].pow(2).sum() + t[2].pow(2).sum() / t[2].pow(2).sum()) / 2
    assert torch.allclose(hidden_state_loss(t, s), ref, rtol=1e-5)
    assert float(hidden_state_loss(t, t)) == 0.0
