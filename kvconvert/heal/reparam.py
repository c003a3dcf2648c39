"""Optimising converted attention weights in their own units.

The converter scales the latent rows of kv_a_proj_with_mqa by a tiny factor (~1e-4..1e-2) so that
kv_a_layernorm acts linearly (docs/formats.md, "The latent RMSNorm made linear"), and compensates in kv_a_layernorm / kv_b_proj. A
plain Adam step of size lr would change those rows by lr in absolute terms: thousands of times their
size. We therefore optimise P with W = s[:, None] * P, where s is a fixed per-row scale (the RMS of
the row's block: latent rows vs RoPE rows of kv_a, whole tensor for the others). Adam is invariant
to gradient scale, so this equals Adam on W with a per-row learning rate lr * s: `lr` becomes a
*relative* step, and one value fits every tensor. The forward pass is the exact stock model
(the latent RMSNorm is computed, not linearised), so what is optimised is what is shipped.

ScaledWeight is the same idea as a torch parametrization for the distillation stage, optionally
with a LoRA delta in the scaled units: W = s * (P0 + (alpha / r) B A), merged at the end.
scheduled_lr is both stages' learning-rate schedule.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def row_scales(name: str, weight: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """[out] positive scale per output row of an attention weight [out, in]."""

    def rms(t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().pow(2).mean().sqrt().clamp_min(1e-30)

    if name == "kv_a_proj_with_mqa":
        r = kv_lora_rank
        latent, rope = weight[:r], weight[r:]
        parts = [rms(latent).expand(r)]
        if rope.shape[0]:
            parts.append(rms(rope).expand(rope.shape[0]))
        return torch.cat(parts).to(weight.dtype)
    return rms(weight).expand(weight.shape[0]).to(weight.dtype).clone()


class ScaledWeight(nn.Module):
    """torch.nn.utils.parametrize parametrization: weight = scale[:, None] * (P + lora delta).

    scale: [out] fixed (a buffer). lora_rank 0 -> P itself is trained (full fine-tuning);
    lora_rank > 0 -> P is frozen and lora_a [r, in], lora_b [out, r] are trained (B starts at 0).
    """

    def __init__(self, scale: torch.Tensor, in_features: int = 0, lora_rank: int = 0, lora_alpha: float = 1.0):
        super().__init__()
        self.register_buffer("scale", scale.detach().clone())
        self.lora_rank = lora_rank
        if lora_rank:
            out_features = scale.shape[0]
            self.lora_a = nn.Parameter(torch.empty(lora_rank, in_features, dtype=scale.dtype))
            nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
            self.lora_b = nn.Parameter(torch.zeros(out_features, lora_rank, dtype=scale.dtype))
            self.lora_scaling = lora_alpha / lora_rank

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        if self.lora_rank:
            p = p + self.lora_scaling * (self.lora_b @ self.lora_a)
        return self.scale[:, None] * p

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        """Stored parameter P for a given weight (LoRA delta starts at 0)."""
        return weight / self.scale[:, None]


def scheduled_lr(step: int, warmup: int, total: int, schedule: str = "cosine", lr: float = 1.0) -> float:
    """The lr of optimizer step `step` (0-based) of `total`: a linear warm-up over `warmup` steps,
    then cosine or linear decay to lr/20, or constant."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "cosine":
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
    if schedule == "linear":
        return lr * max(0.05, 1.0 - progress)
    return lr
