"""Run kvconvert.models' functional decoder on a transformers model's own weights (shared by this
folder's tests; a uniquely named module so `from model_cases import ...` resolves here)."""

from __future__ import annotations

import torch

from kvconvert.models.common import DecoderLayer, rms_norm, short_names

VOCAB = 96


def random_norms(model, seed: int = 0) -> None:
    """Random RMSNorm weights (transformers initialises them to 1, which would hide norm bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))


def functional_logits(model, ids: torch.Tensor, shape, attention_cls, layer_fn, device="cpu") -> torch.Tensor:
    """Logits [B, T, vocab] of ids [B, T] through layer_fn over the model's weights on `device`."""
    state = {k: v.detach().to(device) for k, v in model.state_dict().items()}
    h = state["model.embed_tokens.weight"][ids.to(device)]
    for i in range(shape.layers):
        w = layer_weights(state, i, attention_cls, shape)
        h = layer_fn(h, w, shape)
    return rms_norm(h, state["model.norm.weight"], shape.rms_eps) @ state["lm_head.weight"].T


def layer_weights(state: dict, i: int, attention_cls, shape) -> DecoderLayer:
    """Layer i of a transformers state dict as the runtime reads it (checkpoint names -> typed weights)."""
    prefix = f"model.layers.{i}."
    return DecoderLayer.of(short_names({k: v for k, v in state.items() if k.startswith(prefix)}), attention_cls,
                           shape.hidden_act)


def assert_matches(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """Relative error |ours - ref| / |ref| over the whole tensor below rtol."""
    err = float((ours - ref).norm() / ref.norm())
    assert err < rtol, f"relative error {err:.3g} >= {rtol}"
