"""The functional blocks the layer-wise stage runs on a GPU build every tensor on their input's device.

No GPU here (nor in CI): the `meta` device stands in. A block that made any constant on the CPU
(positions, RoPE tables) would fail with a device mismatch on meta exactly as it would on cuda.
"""

from __future__ import annotations

import pytest
import torch

from kvconvert.mla.llama_block import LlamaShape, llama_attention, llama_layer
from kvconvert.mla.mla_block import MLAShape, mla_attention

B, T, HIDDEN, HEADS, KV_HEADS, D = 2, 16, 64, 4, 2, 16


def _inv_freq(dim: int) -> torch.Tensor:
    # float64 on the CPU, as blocks.student_shape/teacher_shape build it
    return 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _llama_weights(device) -> dict:
    shapes = {"q_proj": (HEADS * D, HIDDEN), "k_proj": (KV_HEADS * D, HIDDEN), "v_proj": (KV_HEADS * D, HIDDEN),
              "o_proj": (HIDDEN, HEADS * D), "input_layernorm": (HIDDEN,), "post_attention_layernorm": (HIDDEN,),
              "gate_proj": (96, HIDDEN), "up_proj": (96, HIDDEN), "down_proj": (HIDDEN, 96)}
    return {k: torch.randn(s, device=device) for k, s in shapes.items()}


def _mla_weights(device, rank=8, rope=8, nope=8, v=16) -> dict:
    shapes = {"q_proj": (HEADS * (nope + rope), HIDDEN), "kv_a_proj_with_mqa": (rank + rope, HIDDEN),
              "kv_a_layernorm": (rank,), "kv_b_proj": (HEADS * (nope + v), rank), "o_proj": (HIDDEN, HEADS * v)}
    return {k: torch.randn(s, device=device) for k, s in shapes.items()}


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_llama_blocks_run_on_the_input_device(device):
    s = LlamaShape(HIDDEN, HEADS, KV_HEADS, D, 1e-5, _inv_freq(D))
    w = _llama_weights(device)
    x = torch.randn(B, T, HIDDEN, device=device)
    assert llama_attention(x, w, s).device.type == device
    assert llama_layer(x, w, s).shape == (B, T, HIDDEN)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_mla_attention_runs_on_the_input_device(device):
    s = MLAShape(heads=HEADS, rank=8, rope_dim=8, nope_dim=8, v_dim=16, latent_eps=1e-6, inv_freq=_inv_freq(8))
    out = mla_attention(torch.randn(B, T, HIDDEN, device=device), _mla_weights(device), s)
    assert out.device.type == device and out.shape == (B, T, HIDDEN)
