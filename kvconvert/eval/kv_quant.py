"""Perplexity and token KL with the KV cache fake-quantized exactly as the engine stores it (CPU).

Every K/V the attention reads goes through a cache hook (kvconvert.quant.hooks.fake_quant_hook:
quantize-dequantize with the calibrated scales), including, in a prefill, the current window's own
keys, as in a paged engine that writes the cache and then attends from it.

Protocol: each window of T tokens predicts tokens 1..T-1; perplexity = exp(mean NLL over all
predictions); KL = mean over the same positions of KL(reference || candidate) in nats, where the
reference is the unquantized source model (docs/calibrate.md, "Evaluation API"). The window
statistics are kvconvert.token_stats' (TokenSums, window_sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvconvert.token_stats import TokenSums, window_sums
from kvconvert.quant.capture import forward_with_hook


@dataclass
class EvalResult:
    """ppl: perplexity; kl: mean token KL(reference || this) in nats; tokens: predictions counted."""

    ppl: float
    kl: float
    tokens: int


@torch.no_grad()
def evaluate_kv_quant(reference_model, candidates: dict[str, tuple], windows: torch.Tensor,
                      batch_size: int = 1, progress=None) -> dict[str, EvalResult]:
    """Perplexity and KL of several fake-quantized candidates against one reference, window by window.

    candidates: name -> (model, hook) where hook is a CacheHook (e.g. kvconvert.quant.hooks.fake_quant_hook);
    the model may differ from the reference (rotated weights). windows: [N, T] token ids.
    Returns name -> EvalResult, plus "reference" (its own perplexity, KL 0).
    """
    sums = {name: TokenSums() for name in ["reference", *candidates]}
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start:start + batch_size]
        ref = reference_model(input_ids=ids, use_cache=False).logits
        sums["reference"] += sum(map(window_sums, ref, ids), TokenSums())  # window by window: [T, V] each
        for name, (model, hook) in candidates.items():
            sums[name] += sum(map(window_sums, forward_with_hook(model, ids, hook), ids, ref), TokenSums())
        if progress is not None:
            progress(min(start + batch_size, windows.shape[0]), windows.shape[0])
    return {name: EvalResult(s.ppl, s.kl_mean, s.tokens) for name, s in sums.items()}
