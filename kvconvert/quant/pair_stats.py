"""Second moments of the post-RoPE query/key pairs, for choosing key pair phases (rotate.pair_phase).

A forward pre-hook on every attention module recomputes the projections from the attention's own
inputs (hidden states and the cos/sin position embeddings the model passes in) and accumulates, per
RoPE pair read as a complex number c = x_first + j x_second:
* E[c^2] and E[|c|^2] of the keys, per KV head (gqa) or of the shared k_rope (mla);
* the same of the queries, summed over the query heads that read each KV head (gqa) or over all
  heads (mla), averaged over tokens.
RoPE multiplies c by e^{j theta t}, so a post-RoPE pair is the pre-RoPE pair times
cos_t + j sin_t of its frequency: no model-specific rotary code is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvconvert.errors import UnsupportedModelError
from kvconvert.kvmath import KVShape
from kvconvert.quant.capture import decoder_layers
from kvconvert.quant.rotate import rope_pairs

STAT_WINDOWS = 8  # windows of the rotation-planning statistics (the first ones of the calibration)


@dataclass
class PairMoments:
    """Per layer, per KV head (gqa: [kv_heads, pairs]; mla: [pairs]) moments of post-RoPE pairs."""

    q_moment: torch.Tensor  # complex128, mean of q^2 (summed over the heads of the group)
    k_moment: torch.Tensor  # complex128, mean of k^2
    q_power: torch.Tensor  # float64, mean of |q|^2 (summed over the heads of the group)
    k_power: torch.Tensor  # float64, mean of |k|^2


def complex_pairs(x: torch.Tensor, interleave: bool) -> torch.Tensor:
    """[..., dim] real -> [..., dim/2] complex128 pairs x_first + j x_second (rotate.rope_pairs order)."""
    first, second = rope_pairs(x.shape[-1], interleave)
    return torch.complex(x[..., first].double(), x[..., second].double())


def rope_phase(position_embeddings) -> torch.Tensor:
    """(cos, sin) [b, T, rot_dim] in transformers' half layout -> e^{j theta t} [b, T, rot_dim/2] complex128.

    The magnitude is kept (some RoPE variants scale cos/sin by an attention factor)."""
    cos, sin = position_embeddings
    half = cos.shape[-1] // 2
    return torch.complex(cos[..., :half].double(), sin[..., :half].double())


def post_rope_pairs(attn, layout: KVShape, hidden_states: torch.Tensor, position_embeddings):
    """Post-RoPE query and key pairs of one attention call, as the cache would store the keys.

    gqa: q [b, T, n_q, d/2], k [b, T, n_kv, d/2]; mla: q [b, T, n_q, rope/2] (rope part of each head),
    k [b, T, 1, rope/2] (the shared k_rope). complex128.
    """
    b, t, _ = hidden_states.shape
    phase = rope_phase(position_embeddings)[:, :, None, :]  # [b, T, 1, pairs]
    if not layout.is_mla:
        if not hasattr(attn, "q_proj") or not hasattr(attn, "k_proj"):
            raise UnsupportedModelError("key pair phases need q_proj / k_proj attention")
        q = attn.q_proj(hidden_states).view(b, t, layout.num_heads, layout.head_dim)
        k = attn.k_proj(hidden_states).view(b, t, layout.num_kv_heads, layout.head_dim)
        return complex_pairs(q, False) * phase, complex_pairs(k, False) * phase
    rank, rope = layout.kv_lora_rank, layout.qk_rope_head_dim
    if hasattr(attn, "q_proj"):
        q = attn.q_proj(hidden_states)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q = q.view(b, t, layout.num_heads, -1)[..., -rope:]
    k = attn.kv_a_proj_with_mqa(hidden_states)[..., rank:].view(b, t, 1, rope)
    return complex_pairs(q, layout.rope_interleave) * phase, complex_pairs(k, layout.rope_interleave) * phase


class PairMomentSums:
    """Running sums of post-RoPE pair moments per layer; feed with add(layer, q, k), read .layer_result(layer)."""

    def __init__(self, layout: KVShape):
        self.layout = layout
        self.sums: list[dict[str, torch.Tensor] | None] = [None] * layout.num_layers
        self.tokens = [0] * layout.num_layers

    def add(self, index: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """q [b, T, n_q, pairs], k [b, T, n_kv, pairs] complex128 post-RoPE pairs (post_rope_pairs)."""
        n_kv = k.shape[2]
        group = q.shape[2] // n_kv
        qg = q.view(*q.shape[:2], n_kv, group, q.shape[-1])  # query heads grouped by the KV head they read
        part = {"q_moment": (qg * qg).sum((0, 1, 3)), "q_power": (qg.abs() ** 2).sum((0, 1, 3)),
                "k_moment": (k * k).sum((0, 1)), "k_power": (k.abs() ** 2).sum((0, 1))}
        prev = self.sums[index]
        self.sums[index] = part if prev is None else {key: prev[key] + part[key] for key in part}
        self.tokens[index] += q.shape[0] * q.shape[1]

    def layer_result(self, index: int) -> PairMoments:
        sums = self.sums[index]
        if sums is None:
            raise UnsupportedModelError(f"layer {index}: attention never ran during the statistics pass")
        mean = {key: v / self.tokens[index] for key, v in sums.items()}
        if self.layout.is_mla:
            mean = {key: v[0] for key, v in mean.items()}  # one shared k_rope "head"
        return PairMoments(**mean)


class PairMomentObserver:
    """Registers the pre-hooks; call .result() after the forward passes, .remove() when done."""

    def __init__(self, model, layout: KVShape):
        self.layout = layout
        self.layers = decoder_layers(model)
        self.sums = PairMomentSums(layout)
        self._handles = [layer.self_attn.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, layer in enumerate(self.layers)]

    def _hook(self, index: int):
        def hook(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            pe = kwargs.get("position_embeddings")
            if h is None or pe is None:
                raise UnsupportedModelError("attention was called without hidden_states/position_embeddings; "
                                            "cannot measure RoPE pair statistics (use --no-rotate)")
            with torch.no_grad():
                self.sums.add(index, *post_rope_pairs(module, self.layout, h, pe))
        return hook

    def result(self) -> list[PairMoments]:
        return [self.sums.layer_result(i) for i in range(self.layout.num_layers)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
