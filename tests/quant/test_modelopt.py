"""kvconvert's amax observer equals NVIDIA ModelOpt's k/v_bmm_quantizer amax (FP8 KV, "max") per layer."""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("modelopt") is None,
                       reason="nvidia-modelopt not installed (optional extra: pip install 'kvconvert[modelopt]')"),
]


def test_amax_matches_modelopt_on_smollm2(smollm2_path):
    from transformers import AutoTokenizer

    from kvconvert.data import calibration_windows
    from kvconvert.quant.calibrate import observe_kv
    from kvconvert.quant.capture import load_hf_model
    from kvconvert.quant.layout import checkpoint_kv_layout
    from kvconvert.quant.modelopt_ref import modelopt_kv_amax

    layout = checkpoint_kv_layout(smollm2_path)
    windows = calibration_windows(AutoTokenizer.from_pretrained(smollm2_path), "builtin", 256, 128)
    model = load_hf_model(smollm2_path)
    ours = observe_kv(model, layout, windows, batch_size=1)
    theirs = modelopt_kv_amax(model, windows)  # modifies the model: run it last
    assert len(theirs) == layout.num_layers == 30
    for layer, (k_amax, v_amax) in enumerate(theirs):
        assert k_amax == pytest.approx(ours[layer]["k"].amax_tensor, rel=0.01), layer
        assert v_amax == pytest.approx(ours[layer]["v"].amax_tensor, rel=0.01), layer
    assert torch.isfinite(torch.tensor(theirs)).all()
