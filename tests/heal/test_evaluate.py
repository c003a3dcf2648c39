"""bench_heal's measurements: perplexity / KL on identical windows, on the models' own device."""

from __future__ import annotations

import math

import pytest
import torch

from kvconvert.heal.evaluate import window_metrics
from kvconvert.quant.capture import load_hf_model


def test_source_against_itself_has_zero_kl_and_the_student_does_not(tiny_teacher, tiny_student):
    source = load_hf_model(tiny_teacher).to("cpu")
    assert next(source.parameters()).device.type == "cpu"
    ids = torch.randint(0, source.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    res = window_metrics(source, {"self": load_hf_model(tiny_teacher), "student": load_hf_model(tiny_student)}, ids)
    assert res["source"]["tokens"] == 2 * 23
    assert res["self"]["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    assert res["self"]["ppl"] == pytest.approx(res["source"]["ppl"], rel=1e-6)
    assert res["student"]["kl_mean"] > 1e-4
    # perplexity is exp(mean NLL): recompute the source's by hand
    logp = torch.log_softmax(source(input_ids=ids).logits[:, :-1].float(), -1)
    nll = -logp.gather(-1, ids[:, 1:, None]).mean()
    assert res["source"]["ppl"] == pytest.approx(math.exp(float(nll)), rel=1e-5)
