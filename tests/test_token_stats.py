"""kvconvert.token_stats: the one NLL / KL / top-1 sum over next-token predictions."""

from __future__ import annotations

import math

import torch

from kvconvert.token_stats import TokenSums, window_sums


def test_sums_match_their_definitions_in_float64():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (300,))  # > 256: two chunks
    ref, logits = torch.randn(300, 50), torch.randn(300, 50)
    got = window_sums(logits, ids, ref)
    logp, logp_ref = torch.log_softmax(logits.double(), -1)[:-1], torch.log_softmax(ref.double(), -1)[:-1]
    assert got.tokens == 299
    assert math.isclose(got.nll, float(-logp.gather(-1, ids[1:, None]).sum()), rel_tol=1e-12)
    assert math.isclose(got.kl, float((logp_ref.exp() * (logp_ref - logp)).sum()), rel_tol=1e-12)
    assert got.top1 == int((logits[:-1].argmax(-1) == ref[:-1].argmax(-1)).sum())


def test_identical_logits_agree_everywhere_with_zero_kl():
    ids = torch.arange(10)
    x = torch.randn(10, 20)
    same = window_sums(x, ids, x.clone())
    assert same.kl == 0.0 and same.top1 == same.tokens == 9 and same.top1_rate == 1.0
    assert window_sums(x, ids).top1 == 0  # no reference: nothing to agree with


def test_sums_add_over_windows():
    a, b = TokenSums(1.0, 0.5, 4, 3), TokenSums(2.0, 0.25, 6, 6)
    total = a + b
    assert total == TokenSums(3.0, 0.75, 10, 9)
    assert math.isclose(total.ppl, math.exp(0.3)) and total.kl_mean == 0.075 and total.top1_rate == 0.9
