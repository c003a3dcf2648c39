"""Sums over next-token predictions: perplexity, KL(reference || model) and top-1 agreement.

One definition for every scorer: validate's windows (kvconvert.eval.metrics.window_stats), the
quantizer and heal evaluators, plan, and the engines that score windows in their own process
(kvconvert.engines.llamacpp's worker sums llama.cpp's logits here, so no logits leave that process).
A floor module (tests/test_import_graph.py LAYERS) so the engines may use it; torch is imported
inside window_sums only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TokenSums:
    """Sums over next-token predictions (float64): nll = sum of -log p(next token), kl = sum over
    positions of KL(reference || this model) in nats, top1 = positions whose most likely token is the
    reference's (0 without a reference), tokens = predictions counted. Adds up over windows."""

    nll: float = 0.0
    kl: float = 0.0
    tokens: int = 0
    top1: int = 0

    def __add__(self, other: TokenSums) -> TokenSums:
        return TokenSums(self.nll + other.nll, self.kl + other.kl, self.tokens + other.tokens, self.top1 + other.top1)

    @property
    def ppl(self) -> float:
        """Perplexity: exp(mean NLL)."""
        return math.exp(self.nll / self.tokens)

    @property
    def kl_mean(self) -> float:
        return self.kl / self.tokens

    @property
    def top1_rate(self) -> float:
        """Share of positions whose argmax equals the reference's (llama-perplexity's "same top p")."""
        return self.top1 / self.tokens


def window_sums(logits, ids, ref_logits=None) -> TokenSums:
    """NLL, KL and top-1 sums of one window's next-token predictions, in float64.

    logits, ref_logits: [T, V] of this model and of the reference for ids [T] (any float dtype, any
    device); positions 0..T-2 predict ids 1..T-1, the last row is not used. kl = sum_t sum_v
    p_ref(v) (log p_ref(v) - log p(v)), 0 without ref_logits; identical logits give exactly 0.
    """
    import torch

    targets = ids[1:].to(logits.device)
    total = TokenSums(tokens=len(targets))
    for start in range(0, len(targets), 256):  # chunks bound the [chunk, V] float64 temporaries
        rows = slice(start, min(start + 256, len(targets)))
        logp = torch.log_softmax(logits[rows].double(), dim=-1)
        total.nll -= float(logp.gather(-1, targets[rows, None]).sum())
        if ref_logits is not None:
            ref = ref_logits[rows].to(logp.device)
            logp_ref = torch.log_softmax(ref.double(), dim=-1)
            total.kl += float((logp_ref.exp() * (logp_ref - logp)).sum())
            total.top1 += int((logits[rows].argmax(-1) == ref.argmax(-1)).sum())
    return total
