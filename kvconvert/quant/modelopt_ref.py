"""Cross-check against NVIDIA ModelOpt (optional extra ``modelopt``; nvidia-modelopt 0.47 tested).

ModelOpt's FP8 KV calibration ("max" algorithm) records the amax of post-RoPE K and V in
``k_bmm_quantizer`` / ``v_bmm_quantizer`` of every attention module. Recipe (docs/calibrate.md): disable every
quantizer first (``{"quantizer_name": "*", "enable": False}``) - FP8_KV_CFG alone leaves ModelOpt's
default weight/activation quantizers on - then FP8_KV_CFG's entries, algorithm "max".
Its NVFP4 fake quant needs CUDA, so only the FP8 amax is compared on CPU.
"""

from __future__ import annotations

import torch

from kvconvert.errors import KVConvertError


def import_mtq():
    """modelopt.torch.quantization, or KVConvertError saying how to install it."""
    try:
        import modelopt.torch.quantization as mtq
    except Exception as exc:  # noqa: BLE001 - ImportError, or modelopt's own import-time failures
        raise KVConvertError(f"nvidia-modelopt is not usable ({type(exc).__name__}: {exc}); "
                             "pip install 'kvconvert[modelopt]'") from None
    return mtq


@torch.no_grad()
def modelopt_kv_amax(model, windows: torch.Tensor) -> list[tuple[float, float]]:
    """Per layer (k_amax, v_amax) from ModelOpt's FP8 KV calibration of `model` (modified in place).

    windows: [N, T] token ids, forwarded one at a time in the calibration loop.
    """
    import warnings

    mtq = import_mtq()
    cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}, *mtq.FP8_KV_CFG["quant_cfg"]],
           "algorithm": "max"}

    def forward_loop(m):
        for row in windows:
            m(input_ids=row[None], use_cache=False)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, forward_loop)
    out = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        k_q, v_q = getattr(attn, "k_bmm_quantizer", None), getattr(attn, "v_bmm_quantizer", None)
        if k_q is None or v_q is None or k_q.amax is None or v_q.amax is None:
            raise KVConvertError(f"layer {i}: ModelOpt recorded no k/v_bmm_quantizer amax")
        out.append((float(k_q.amax.max()), float(v_q.amax.max())))
    return out
