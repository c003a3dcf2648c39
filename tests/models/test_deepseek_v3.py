"""kvconvert.models.deepseek_v3 beyond the decoder (test_decoders): yarn's softmax scale, MoE refusal."""

from __future__ import annotations

import pytest
from model_cases import YARN

from kvconvert.errors import UnsupportedModelError
from kvconvert.models import deepseek_v3 as ds
from kvconvert.models.common import yarn_softmax_scale


def test_yarn_softmax_scale_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    assert yarn_softmax_scale(YARN, 32 ** -0.5) == pytest.approx(yarn_apply_mscale(YARN, 32 ** -0.5), rel=1e-12)
    assert yarn_softmax_scale(YARN, 32 ** -0.5) != 32 ** -0.5


def test_moe_layers_are_refused():
    with pytest.raises(UnsupportedModelError, match="first_k_dense_replace=1"):
        ds.check_dense({"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8})
