"""Calibrated KV scales: validation, and reading them back from a calibrated checkpoint.

A :class:`KVScales` holds, per decoder layer, the exported K and V scales (amax/448 for FP8 E4M3
and NVFP4, amax/57344 for FP8 E5M2): float32 tensors of shape ``[]`` (per tensor) or
``[kv_heads]`` (per head). For MLA there is ONE scale per layer for the cached ``[latent | k_rope]``
row; it is stored as both ``k`` and ``v`` (vLLM's MLA path applies ``k_scale`` to the whole row).

Zero, negative, NaN or inf scales are refused at construction (a zero scale silently turns a cache
into NaNs or zeros; llm-compressor #2117 shipped all-zero scales).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvconvert.errors import CheckpointError, KVConvertError
from kvconvert.kvformat import SCALE_SUFFIXES, scale_names
from kvconvert.quant.fake_quant import check_kv_dtype
from kvconvert.quant.options import GRANULARITIES

_SCALE_RE = re.compile(r"^model\.layers\.\d+\.self_attn\.(?:%s)$" % "|".join(
    re.escape(suffix) for names in SCALE_SUFFIXES.values() for suffix in names.values()))


def is_kv_scale_name(name: str) -> bool:
    """True for every tensor name kvconvert writes for KV scales (both formats)."""
    return bool(_SCALE_RE.match(name))


@dataclass
class KVScales:
    """Per-layer K/V scales (see module docstring). k[l], v[l]: float32 [] or [kv_heads]."""

    kv_dtype: str
    granularity: str
    layout_kind: str  # kvconvert.kvmath.KVShape.kind: "MHA", "GQA", "MQA" or "MLA"
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def __post_init__(self):
        check_kv_dtype(self.kv_dtype)
        if self.granularity not in GRANULARITIES:
            raise KVConvertError(f"unknown granularity {self.granularity!r}: use tensor or head")
        if len(self.k) != len(self.v) or not self.k:
            raise KVConvertError("KV scales need one k and one v scale per layer")
        self.k = [torch.as_tensor(s, dtype=torch.float32).detach().clone() for s in self.k]
        self.v = [torch.as_tensor(s, dtype=torch.float32).detach().clone() for s in self.v]
        for layer, (ks, vs) in enumerate(zip(self.k, self.v)):
            _check_scale(ks, layer, "k_scale")
            _check_scale(vs, layer, "v_scale")

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def scale(self, layer: int, kind: str) -> torch.Tensor:
        """Scale for cached tensor `kind` ("k", "v", or "kv" for the MLA row) of `layer`."""
        return self.v[layer] if kind == "v" else self.k[layer]

    def to_json(self) -> dict:
        return {"kv_dtype": self.kv_dtype, "granularity": self.granularity, "layout": self.layout_kind,
                "k_scale": [s.tolist() for s in self.k], "v_scale": [s.tolist() for s in self.v]}


def _check_scale(s: torch.Tensor, layer: int, name: str) -> None:
    if s.dim() > 1:
        raise KVConvertError(f"layer {layer} {name}: expected a scalar or [heads] scale, got shape {tuple(s.shape)}")
    if not bool(torch.isfinite(s).all()):
        raise KVConvertError(
            f"layer {layer} {name} is NaN or inf: refusing to write it; the calibration data produced "
            "non-finite activations at this layer")
    if bool((s <= 0).any()):
        raise KVConvertError(
            f"layer {layer} {name} is {s.min().item():g} (zero or negative): refusing to write it; this layer's "
            "cache was all zeros on the calibration data - use more or different --calib-data")


def read_kv_scales(folder: str | Path) -> KVScales:
    """KVScales of a checkpoint written by ``kvconvert calibrate`` (either naming; vLLM names win), as the engine
    applies them (kvformat's engine_scales: int8's K and V both at the larger).

    kv_dtype/granularity/layout come from calibration_report.json.
    """
    from kvconvert.checkpoint import CheckpointReader

    folder = Path(folder)
    report_path = folder / "calibration_report.json"
    if not report_path.is_file():
        raise CheckpointError(f"{folder}: no calibration_report.json; run `kvconvert calibrate` on it first")
    report = json.loads(report_path.read_text())
    reader = CheckpointReader(folder, verify=False)

    def first(names: list[str]) -> torch.Tensor | None:  # vLLM names win over ModelOpt ones
        name = next((n for n in names if n in reader.weight_map), None)
        return None if name is None else reader.get(name, torch.float32).reshape(-1)

    granularity = report["granularity"]
    fmt = check_kv_dtype(report["kv_dtype"])
    ks, vs = [], []
    for layer in range(int(report["num_layers"])):
        k = first(scale_names("k", layer) + scale_names("kv", layer))
        if k is None:
            raise CheckpointError(f"{folder}: no k_scale for layer {layer}; recalibrate")
        v = first(scale_names("v", layer))
        v = k if v is None else v  # MLA ModelOpt export writes k_scale only
        k, v = fmt.engine_scales(k, v)  # int8: one scale for K and V, as the engine stores them
        ks.append(k if granularity == "head" else k.reshape(()))
        vs.append(v if granularity == "head" else v.reshape(()))
    # reports written before the layout names were KVShape's say "gqa" (any Llama attention) or "mla"
    return KVScales(report["kv_dtype"], granularity, report["layout"].upper(), ks, vs)
