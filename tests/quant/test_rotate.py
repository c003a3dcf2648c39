"""Rotations folded into the weights leave fp32 logits unchanged; the export path applies the same math."""

import pytest
import torch
from quant_cases import make_deepseek, make_llama

from kvconvert.checkpoint import CheckpointReader
from kvconvert.quant.capture import load_hf_model
from kvconvert.quant.export import changed_attention
from kvconvert.quant.layout import checkpoint_kv_layout
from kvconvert.quant.rotate import (
    RotationPlan,
    apply_plan_to_model,
    block_hadamard,
    hadamard,
    pair_amax_from_channels,
    pair_equalizing_scale,
)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_hadamard_is_orthogonal():
    for n in (1, 2, 16, 64):
        h = hadamard(n)
        torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64))
    r = block_hadamard(32, 16, seed=3)
    torch.testing.assert_close(r @ r.T, torch.eye(32, dtype=torch.float64))
    assert torch.count_nonzero(r[:16, 16:]) == 0  # block diagonal


def test_pair_equalizing_scale():
    a = torch.tensor([[4.0, 1.0, 0.0, 2.0]])
    alpha = pair_equalizing_scale(a, strength=1.0)
    gm = (4.0 * 1.0 * 2.0) ** (1 / 3)
    torch.testing.assert_close(alpha, torch.tensor([[gm / 4, gm, 1.0, gm / 2]], dtype=torch.float64))
    assert torch.equal(pair_equalizing_scale(a, 0.0), torch.ones(1, 4, dtype=torch.float64))
    assert pair_amax_from_channels(torch.tensor([1.0, 5.0, 3.0, 2.0]), interleave=False).tolist() == [3.0, 5.0]
    assert pair_amax_from_channels(torch.tensor([1.0, 5.0, 3.0, 2.0]), interleave=True).tolist() == [5.0, 3.0]


def random_plan(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    dim = layout.kv_lora_rank if layout.is_mla else layout.head_dim
    pairs = (layout.qk_rope_head_dim // 2,) if layout.is_mla else (layout.num_kv_heads, layout.head_dim // 2)
    # complex pair factors: a scale and a phase per RoPE pair
    key = [torch.polar(0.25 + 3 * torch.rand(pairs, generator=g, dtype=torch.float64),
                       2 * torch.pi * torch.rand(pairs, generator=g, dtype=torch.float64))
           for _ in range(layout.num_layers)]
    return RotationPlan(layout, block_hadamard(dim, 16, seed=seed), key)


@pytest.mark.parametrize("bias", [False, True])
def test_gqa_rotation_keeps_logits(tmp_path, bias):
    path = make_llama(tmp_path / "m", seed=4, bias=bias)
    r, layout, model = CheckpointReader(path), checkpoint_kv_layout(path), load_hf_model(path)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(5))
    before = logits(model, ids)
    plan = random_plan(layout)
    apply_plan_to_model(model, plan)
    after = logits(model, ids)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    # the weights really changed, and the export path computes the same tensors as the in-memory fold
    exported = {**changed_attention(r, layout, plan, None, 0), **changed_attention(r, layout, plan, None, 1)}
    v0 = model.model.layers[0].self_attn.v_proj.weight
    assert not torch.allclose(v0, r.get("model.layers.0.self_attn.v_proj.weight"))
    torch.testing.assert_close(exported["model.layers.0.self_attn.v_proj.weight"], v0, rtol=0, atol=0)
    torch.testing.assert_close(exported["model.layers.1.self_attn.q_proj.weight"],
                               model.model.layers[1].self_attn.q_proj.weight, rtol=0, atol=0)


@pytest.mark.parametrize("interleave", [True, False])
def test_mla_rotation_keeps_logits_with_nonuniform_norm(tmp_path, interleave):
    path = make_deepseek(tmp_path / "d", seed=6, rope_interleave=interleave)
    layout, model = checkpoint_kv_layout(path), load_hf_model(path)
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(7))
    before = logits(model, ids)
    apply_plan_to_model(model, random_plan(layout, seed=1))
    norm = model.model.layers[0].self_attn.kv_a_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))  # folded into kv_b_proj
    torch.testing.assert_close(logits(model, ids), before, rtol=1e-5, atol=1e-5)
