"""Layer-wise reconstruction on a tiny random Llama -> MLA conversion."""

import math

import pytest
import torch

from kvconvert.checkpoint import CheckpointReader
from kvconvert.heal.layerwise import (
    attention_tensors, block_targets, fit_attention_block, read_layer, relative_error, relinearize_latent,
)
from kvconvert.heal.reparam import ScaledWeight, row_scales
from kvconvert.models import deepseek_v3 as ds, llama
from kvconvert.models.common import rms_norm, take
from kvconvert.models.deepseek_v3 import MLAAttention, MLAShape
from kvconvert.models.llama import LlamaAttention, LlamaShape
from kvconvert.recipe import LayerwiseStage

from heal_cases import convert_tiny, layerwise_recipe


def _layer0(student, teacher, n=12, t=128, seed=0):
    s_reader, t_reader = CheckpointReader(student), CheckpointReader(teacher)
    s_shape, t_shape = MLAShape.from_config(s_reader.config), LlamaShape.from_config(t_reader.config)
    ids = torch.randint(0, s_reader.config["vocab_size"], (n, t), generator=torch.Generator().manual_seed(seed))
    h = t_reader.get("model.embed_tokens.weight")[ids]
    return s_shape, t_shape, h, read_layer(t_reader, 0, LlamaAttention), read_layer(s_reader, 0, MLAAttention)


def test_fit_reduces_block_error(tiny_student, tiny_teacher):
    s_shape, t_shape, h, tw, sw = _layer0(tiny_student, tiny_teacher)
    x, y, _ = block_targets(h, h, tw, sw, t_shape, s_shape, "student_input")
    attn = attention_tensors(sw.attn)
    stage = LayerwiseStage(steps=40, batch_windows=4, lr=0.01)
    fit = fit_attention_block(x[:10], y[:10], attn, s_shape, stage, torch.Generator().manual_seed(0),
                              x[10:], y[10:])
    rep = fit.report
    assert rep["rel_err_before"] == pytest.approx(relative_error(x[:10], y[:10], attn, s_shape))
    assert rep["rel_err_after"] < 0.8 * rep["rel_err_before"]
    assert rep["val_rel_err_after"] < rep["val_rel_err_before"]  # held-out windows improve too
    assert rep["rel_err_after"] == pytest.approx(relative_error(x[:10], y[:10], fit.weights, s_shape), rel=1e-6)
    # kv_a_layernorm is not trained and stays uniform
    assert torch.equal(fit.weights["kv_a_layernorm"], attn["kv_a_layernorm"])
    assert fit.weights["kv_a_layernorm"].unique().numel() == 1


def test_relinearize_keeps_function(tiny_student, tiny_teacher):
    """Pushing the latent out of the norm's linear range and pulling it back: the block output
    changes by about the nonlinearity (<= rho/2 relative), not more."""
    s_shape, t_shape, h, tw, sw = _layer0(tiny_student, tiny_teacher, n=2, t=64)
    x = rms_norm(h, sw.input_layernorm, s_shape.rms_eps)
    w = attention_tensors(sw.attn)
    r = s_shape.rank
    grown = dict(w)
    kv_a = w["kv_a_proj_with_mqa"].clone()
    kv_a[:r] *= 3.0
    grown["kv_a_proj_with_mqa"] = kv_a
    grown["kv_b_proj"] = w["kv_b_proj"] / 3.0
    limit = 1e-4 * s_shape.latent_eps
    fixed, factor = relinearize_latent(x, grown, s_shape, limit)
    assert factor < 1.0
    c = x @ fixed["kv_a_proj_with_mqa"][:r].T
    assert float(c.pow(2).mean(-1).max()) <= limit * (1 + 1e-4)
    y0, y1 = ds.attention(x, take(MLAAttention, w), s_shape), ds.attention(x, take(MLAAttention, fixed), s_shape)
    assert float((y1 - y0).norm() / y0.norm()) < 5e-3
    same, one = relinearize_latent(x, w, s_shape, 1.0)  # already linear enough: untouched
    assert one == 1.0 and same is w


def test_scaled_weight_roundtrip_and_row_scales():
    torch.manual_seed(0)
    w = torch.randn(12, 5)
    w[:8] *= 1e-4  # latent rows scaled tiny as the converter does
    s = row_scales("kv_a_proj_with_mqa", w, 8)
    assert s[:8].unique().numel() == 1 and s[8:].unique().numel() == 1
    assert math.isclose(float(s[0]), float(w[:8].pow(2).mean().sqrt()), rel_tol=1e-6)
    p = ScaledWeight(s)
    assert torch.allclose(p(p.right_inverse(w)), w)
    lora = ScaledWeight(s, in_features=5, lora_rank=2, lora_alpha=4.0)
    assert torch.allclose(lora(lora.right_inverse(w)), w)  # LoRA B starts at zero


def test_teacher_input_target_is_teacher_block(tiny_student, tiny_teacher):
    s_shape, t_shape, h, tw, sw = _layer0(tiny_student, tiny_teacher, n=2, t=32)
    h_s = h + 0.1 * torch.randn_like(h)
    x, y, a_t = block_targets(h, h_s, tw, sw, t_shape, s_shape, "teacher_input")
    xt = rms_norm(h, tw.input_layernorm, t_shape.rms_eps)
    assert torch.allclose(x, xt) and torch.allclose(y, llama.attention(xt, tw.attn, t_shape)) and torch.equal(y, a_t)
    x, y, _ = block_targets(h, h_s, tw, sw, t_shape, s_shape, "student_residual")
    assert torch.allclose(y, h + a_t - h_s, atol=1e-6)


@pytest.mark.parametrize("q_rank", [None, 16])
def test_heal_layerwise_writes_stock_checkpoint(q_rank, tiny_student, tiny_teacher, text_file, tmp_path):
    """Also for a conversion with q_lora_rank (q_a_proj / q_b_proj); q_a_layernorm stays fixed."""
    import json

    from transformers import DeepseekV3ForCausalLM

    from kvconvert.checkpoint import verify_manifest
    from kvconvert.recipe import heal

    student = convert_tiny(tiny_teacher, tmp_path / "qlora", text_file, q_rank=q_rank) if q_rank else tiny_student
    out = tmp_path / "healed"
    report = heal(student, tiny_teacher, layerwise_recipe(text_file, steps=20), out, progress=False)
    lw = report["stages"]["heal_layerwise"]
    assert len(lw["layers"]) == 2 and lw["mean_rel_err_after"] < lw["mean_rel_err_before"]
    config = DeepseekV3ForCausalLM.from_pretrained(str(out)).config  # stock transformers, no remote code
    assert (config.kv_lora_rank, config.q_lora_rank) == (8, q_rank)
    assert verify_manifest(out) == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kvconvert_heal"]["data"]["layerwise"]["tokens"] > 0
    assert manifest["kvconvert_mla"]["rank"] == 8  # the converter's record is carried over
    s, h = CheckpointReader(student), CheckpointReader(out)
    fixed = ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"]
    for name in fixed + (["model.layers.0.self_attn.q_a_layernorm.weight"] if q_rank else []):
        assert torch.equal(s.get(name), h.get(name)), name  # MLP and norms untouched
    trained = "model.layers.0.self_attn." + ("q_b_proj" if q_rank else "q_proj") + ".weight"
    assert not torch.equal(s.get(trained), h.get(trained))


def test_layerwise_resumes_from_saved_layers(tiny_student, tiny_teacher, text_file, tmp_path, monkeypatch):
    """A layer-wise run interrupted after layer 0 reuses it and ends identical to a full run (made
    by `kvconvert heal`, which leaves its report and no state behind)."""
    import yaml

    from kvconvert.commands.main import main
    from kvconvert.heal import layerwise
    from kvconvert.heal.api import state_dir_for
    from kvconvert.recipe import heal

    recipe = layerwise_recipe(text_file, steps=5)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    full = tmp_path / "full"
    main(["heal", "--student", str(tiny_student), "--teacher", str(tiny_teacher), "--recipe", str(tmp_path / "r.yaml"),
          "--out", str(full), "--no-progress", "--threads", "1"])
    assert (full / "heal_report.json").is_file() and not state_dir_for(full).exists()

    calls = []
    real_fit = layerwise.fit_attention_block

    def fit_then_stop(*a, **kw):
        if calls:
            raise KeyboardInterrupt  # the "kill" after layer 0 was saved
        calls.append(1)
        return real_fit(*a, **kw)

    part = tmp_path / "part"
    with monkeypatch.context() as patch:
        patch.setattr(layerwise, "fit_attention_block", fit_then_stop)
        with pytest.raises(KeyboardInterrupt):
            heal(tiny_student, tiny_teacher, recipe, part, progress=False)
    assert not part.exists() and (state_dir_for(part) / "layerwise" / "layer_00000.safetensors").is_file()
    heal(tiny_student, tiny_teacher, recipe, part, progress=False)
    a, b = CheckpointReader(full), CheckpointReader(part)
    for name in a.keys():
        assert torch.equal(a.get(name), b.get(name)), name
