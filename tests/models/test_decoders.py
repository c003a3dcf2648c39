"""kvconvert.models' decoders (llama, deepseek_v3) against transformers' LlamaForCausalLM /
DeepseekV3ForCausalLM: random small configs (model_cases.VARIANTS), fp32, the whole decoder's logits
within 1e-5 relative. The functional blocks compute RoPE angles in float64, transformers in fp32:
only rounding differs."""

from __future__ import annotations

import pytest
import torch
from model_cases import ARCHS, VARIANTS, VOCAB, assert_matches, build, functional_logits


@pytest.mark.parametrize("arch, variant", sorted(VARIANTS))
def test_decoder_matches_transformers(arch, variant):
    model, shape = build(arch, **VARIANTS[arch, variant])
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        ours = functional_logits(model, ids, shape, arch)
    assert_matches(ours, ref)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_runs_on_the_input_device(arch, device):
    """No constant (positions, RoPE tables) is made on the CPU: `meta` fails on a device mismatch
    exactly as cuda would (the layer-wise stage runs these blocks on a GPU)."""
    model, shape = build(arch)
    ids = torch.randint(0, VOCAB, (2, 16))
    assert functional_logits(model, ids, shape, arch, device).device.type == device
