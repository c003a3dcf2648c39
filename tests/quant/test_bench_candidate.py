"""scripts/bench_common.calibrated_candidate: the candidate a quality benchmark scores is the
calibrated checkpoint as an engine runs it. calibrate folds each scale into the weights by a power of
two even when it rotates nothing (kvconvert.quant.fold), so the candidate must be the written model
with the written (remaining) scales; scoring an unrotated calibration on the source's weights with the
remaining scales would score it at the wrong scale (bench_calibrate's naive rows)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvconvert.quant.capture import forward_with_hook, load_hf_model
from kvconvert.quant.hooks import fake_quant_hook
from kvconvert.quant.layout import checkpoint_kv_layout
from kvconvert.quant.options import CalibrateOptions
from kvconvert.quant.scales import read_kv_scales

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_an_unrotated_calibration_is_scored_as_written(tiny_llama, tmp_path, kv_dtype):
    sys.path.insert(0, str(SCRIPTS))
    from bench_common import calibrated_candidate

    options = CalibrateOptions(kv_dtype=kv_dtype, observer="amax", rotate=False, calib_tokens=512, window_len=64)
    report, (model, hook) = calibrated_candidate(tiny_llama, options, tmp_path / "out")
    assert report["rotation"] is None
    folding = json.loads((tmp_path / "out" / "calibration_report.json").read_text())["scale_folding"]
    assert any(f != 1.0 for f in folding["f_k"] + folding["f_v"])  # the weights did change
    remaining = read_kv_scales(tmp_path / "out")
    calibrated = replace(remaining, k=[s * f for s, f in zip(remaining.k, folding["f_k"])],
                         v=[s * f for s, f in zip(remaining.v, folding["f_v"])])
    layout = checkpoint_kv_layout(tiny_llama)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    # the source with the calibrated scales stores the same cache values up to powers of two: equal logits
    expected = forward_with_hook(load_hf_model(tiny_llama), ids, fake_quant_hook(layout, calibrated))
    torch.testing.assert_close(forward_with_hook(model, ids, hook), expected, rtol=1e-5, atol=1e-5)
