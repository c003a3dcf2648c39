"""The cache hook sees exactly what the engine caches (post-RoPE K/V; MLA latent after its norm and
post-RoPE k_rope), and calibration refuses non-finite activations naming the layer."""

import pytest
import torch

from kvconvert.errors import KVConvertError, UnsupportedModelError
from kvconvert.quant.calibrate import CalibrationSettings, calibrate_model, observe_kv
from kvconvert.quant.capture import cache_hook, load_hf_model, run_with_hook
from kvconvert.quant.layout import checkpoint_kv_layout, detect_kv_layout


def capture_layer0(model, layout, ids):
    seen = {}

    def row_hook(layer_idx, kind, x):
        if layer_idx == 0:
            seen[kind] = x.clone()
        return x

    run_with_hook(model, ids, cache_hook(layout, row_hook), batch_size=ids.shape[0])
    return seen


@torch.no_grad()
def test_llama_cache_sees_post_rope_k_and_v(tiny_llama):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, layout = load_hf_model(tiny_llama), checkpoint_kv_layout(tiny_llama)
    assert (layout.kind, layout.num_kv_heads, layout.head_dim, layout.cached_names) == ("GQA", 2, 16, ("k", "v"))
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    seen = capture_layer0(model, layout, ids)
    attn = model.model.layers[0].self_attn
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    k = attn.k_proj(h).view(2, 12, 2, 16).transpose(1, 2)
    v = attn.v_proj(h).view(2, 12, 2, 16).transpose(1, 2)
    cos, sin = model.model.rotary_emb(h, torch.arange(12)[None].expand(2, -1))
    _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(seen["k"], k_rot, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(seen["v"], v, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_mla_cache_sees_normed_latent_and_rope_key_in_engine_order(tiny_deepseek):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )

    model, layout = load_hf_model(tiny_deepseek), checkpoint_kv_layout(tiny_deepseek)
    assert (layout.kind, layout.row_dim, layout.kv_lora_rank, layout.rope_interleave) == ("MLA", 48, 32, True)
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(1))
    seen = capture_layer0(model, layout, ids)
    attn = model.model.layers[0].self_attn
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    latent, k_rope = attn.kv_a_proj_with_mqa(h).split([32, 16], dim=-1)
    latent = attn.kv_a_layernorm(latent)
    cos, sin = model.model.rotary_emb(h, torch.arange(10)[None])
    k_rope = k_rope.view(1, 1, 10, 16)
    _, k_rot = apply_rotary_pos_emb_interleave(k_rope, k_rope, cos, sin)  # HF order [even | odd]
    engine = torch.stack((k_rot[..., :8], k_rot[..., 8:]), dim=-1).flatten(-2)  # weights' interleaved order
    torch.testing.assert_close(seen["kv"][..., :32], latent.view(1, 1, 10, 32), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(seen["kv"][..., 32:], engine, rtol=1e-6, atol=1e-6)


def test_nan_activation_names_the_layer(tiny_llama):
    model, layout = load_hf_model(tiny_llama), checkpoint_kv_layout(tiny_llama)
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[3, 0] = float("nan")
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    with pytest.raises(KVConvertError, match="layer 1: non-finite value"):
        calibrate_model(model, layout, ids, CalibrationSettings("fp8", observer="amax"))


def test_mla_tensors_need_deepseek_v3():  # no attention at all: test_quant_cli's no-attention case
    with pytest.raises(UnsupportedModelError, match="deepseek_v3"):
        detect_kv_layout({"model_type": "custom_mla", "num_hidden_layers": 1, "kv_lora_rank": 8,
                          "qk_rope_head_dim": 4, "num_attention_heads": 2},
                         ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])


def test_observe_counts_every_window(tiny_llama):
    model, layout = load_hf_model(tiny_llama), checkpoint_kv_layout(tiny_llama)
    ids = torch.randint(0, 512, (5, 8), generator=torch.Generator().manual_seed(3))
    obs = observe_kv(model, layout, ids, batch_size=2)  # batches of 2, 2, 1
    assert all(o[kind].tokens == 40 for o in obs for kind in ("k", "v"))
