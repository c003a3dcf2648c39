"""kvconvert's amax observer equals NVIDIA ModelOpt's k/v_bmm_quantizer amax (FP8 KV, "max") per layer
(optional extra ``modelopt``; nvidia-modelopt 0.47 tested).

ModelOpt's FP8 KV calibration ("max" algorithm) records the amax of post-RoPE K and V in
``k_bmm_quantizer`` / ``v_bmm_quantizer`` of every attention module. Recipe (docs/calibrate.md): disable every
quantizer first (``{"quantizer_name": "*", "enable": False}``) - FP8_KV_CFG alone leaves ModelOpt's
default weight/activation quantizers on - then FP8_KV_CFG's entries, algorithm "max".
Its NVFP4 fake quant needs CUDA, so only the FP8 amax is compared on CPU.
"""

import importlib.util
import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("modelopt") is None,
                       reason="nvidia-modelopt not installed (optional extra: pip install 'kvconvert[modelopt]')"),
]


def modelopt_kv_amax(model, windows: torch.Tensor) -> list[tuple[float, float]]:
    """Per layer (k_amax, v_amax) from ModelOpt's FP8 KV calibration of `model` (modified in place);
    windows [N, T] token ids are forwarded one at a time in the calibration loop."""
    import modelopt.torch.quantization as mtq

    cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}, *mtq.FP8_KV_CFG["quant_cfg"]],
           "algorithm": "max"}

    def forward_loop(m):
        for row in windows:
            m(input_ids=row[None], use_cache=False)

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, forward_loop)
    return [(float(layer.self_attn.k_bmm_quantizer.amax.max()), float(layer.self_attn.v_bmm_quantizer.amax.max()))
            for layer in model.model.layers]


def test_amax_matches_modelopt_on_smollm2(smollm2_path):
    from transformers import AutoTokenizer

    from kvconvert.data import calibration_windows
    from kvconvert.quant.calibrate import observe_kv
    from kvconvert.quant.capture import load_hf_model
    from kvconvert.quant.layout import checkpoint_kv_layout

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
