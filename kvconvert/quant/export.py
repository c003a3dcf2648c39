"""Write calibrated KV scales into a checkpoint: folded into the weights by powers of two (fold.py,
so engines that ignore the scales store the calibrated values too), the rest in the names engines
read (docs/calibrate.md, docs/engines.md).

vLLM / compressed-tensors (``--format vllm``):
  ``model.layers.N.self_attn.k_scale`` / ``.v_scale`` float32, shape ``[1]`` (per tensor) or
  ``[kv_heads, 1, 1]`` (per head, ``strategy: attn_head``) - the shapes llm-compressor writes and
  compressed-tensors registers, so transformers (with compressed-tensors installed) loads them;
  vLLM flattens both. config.json gets ``quantization_config`` = {"quant_method":
  "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy":
  "tensor"|"attn_head", "dynamic": false, "symmetric": true}, ...}.
ModelOpt / TensorRT-LLM (``--format modelopt``):
  ``self_attn.k_proj.k_scale`` / ``self_attn.v_proj.v_scale`` float32 scalars (per tensor only),
  plus hf_quant_config.json {"producer": {"name": "kvconvert", "version"}, "quantization":
  {"quant_algo": null, "kv_cache_quant_algo": "FP8"|"NVFP4"|"INT8"}}. INT8 (amax/127) is TensorRT-LLM's INT8
  cache: the engine stores K and V at one scale, max(k_scale, v_scale), so calibrate writes the two equal
  (calibrate.tie_kv_scales); ModelOpt's own HF export refuses an INT8 KV cache (docs/engines.md).
MLA (DeepSeek-V3): the engine caches one [latent | k_rope] row and vLLM applies ``k_scale`` to the
whole row; kvconvert writes that one row scale as both ``self_attn.k_scale`` and ``.v_scale`` (vLLM)
and as ``self_attn.kv_a_proj_with_mqa.k_scale`` (ModelOpt-style name SGLang remaps for MLA).

Which format goes under which names, its scale convention and its ModelOpt algorithm name are
kvconvert.kvformat's: amax/448 for FP8 E4M3 and for NVFP4 (ModelOpt >= 0.42 / TensorRT-LLM; the
NVFP4 global scale is k_scale/6); FP8 E5M2 (amax/57344) has no checkpoint format in either engine
(vLLM refuses fp8_e5m2 with a kv-cache scheme, ModelOpt has no E5M2 KV): its scales are written
under the vLLM names for kvconvert's runtime, with no quantization_config.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch

from kvconvert import __version__
from kvconvert.errors import KVConvertError
from kvconvert.kvformat import SCALE_SUFFIXES, kv_format, kv_pair, scale_name
from kvconvert.kvmath import MLA, KVShape
from kvconvert.quant.fold import fold_layer, fold_plan
from kvconvert.quant.rotate import RotationPlan
from kvconvert.quant.scales import KVScales, is_kv_scale_name



def resolve_format(fmt: str, kv_dtype: str, granularity: str) -> tuple[str, ...]:
    """Export formats for a request: ("vllm",), ("modelopt",) or both. Refuses impossible combinations."""
    kv = kv_pair(kv_dtype).k  # a mixed pair is two llama.cpp block types: no scale, as its K half
    if not kv.has_kv_scale:  # llama.cpp's types: block scales set as rows are written, none in the checkpoint
        if fmt != "auto" or granularity != "tensor":
            raise KVConvertError(f"{kv.title} has no KV scales to export (llama.cpp sets a scale per block of "
                                 f"{kv.block} as it writes the cache): drop --format / --granularity; the weights are "
                                 "written for llama.cpp, and `kvconvert export-gguf` makes the file it loads")
        return ()
    if fmt == "auto":  # every export the format has; per-head scales only under the vLLM names
        fmt = kv.exports[0] if len(kv.exports) == 1 else "vllm" if granularity == "head" else "both"
    formats = tuple(SCALE_SUFFIXES) if fmt == "both" else (fmt,)
    for f in formats:
        if f not in SCALE_SUFFIXES:
            raise KVConvertError(f"unknown --format {fmt!r}: use auto, vllm, modelopt or both")
    if "modelopt" in formats and "modelopt" not in kv.exports:
        raise KVConvertError(f"ModelOpt/TensorRT-LLM have no {kv.title} KV cache: use --format vllm or --kv-dtype fp8")
    if "modelopt" in formats and granularity == "head":
        raise KVConvertError("ModelOpt/TensorRT-LLM read per-tensor KV scales only: use --granularity tensor or --format vllm")
    if "vllm" in formats and "vllm" not in kv.exports:
        raise KVConvertError(f"compressed-tensors/vLLM have no static {kv.title} KV-cache scheme: use --format "
                             f"modelopt (the default for {kv.name})")
    return formats


def scale_tensors(scales: KVScales, layout: KVShape, formats: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors for the scales, by name (see module docstring for names and shapes)."""
    out = {}
    for layer in range(scales.num_layers):
        if "vllm" in formats:  # the MLA row's one scale as both k_scale and v_scale
            shape = (-1, 1, 1) if scales.granularity == "head" else (1,)
            for kind in ("k", "v"):
                out[scale_name("vllm", kind, layer)] = scales.scale(layer, kind).float().reshape(shape).clone()
        if "modelopt" in formats:
            for kind in layout.cached_names:
                out[scale_name("modelopt", kind, layer)] = scales.scale(layer, kind).float().reshape(()).clone()
    return out


def quantization_config(scales: KVScales) -> dict | None:
    """compressed-tensors quantization_config for config.json (None for fp8_e5m2, see docstring)."""
    if not kv_format(scales.kv_dtype).compressed_tensors:
        return None
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "compressed",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": {
            "num_bits": 8,
            "type": "float",
            "strategy": "attn_head" if scales.granularity == "head" else "tensor",
            "dynamic": False,
            "symmetric": True,
        },
    }


def hf_quant_config(scales: KVScales) -> dict:
    return {
        "producer": {"name": "kvconvert", "version": __version__},
        "quantization": {"quant_algo": None,
                         "kv_cache_quant_algo": kv_format(scales.kv_dtype).modelopt_algo},
    }


def output_config(src_config: dict, scales: KVScales, formats: tuple[str, ...]) -> dict:
    config = {k: v for k, v in src_config.items() if k != "quantization_config"}
    if "vllm" in formats:
        qc = quantization_config(scales)
        if qc is not None:
            config["quantization_config"] = qc
    return config


def changed_attention(reader, layout: KVShape, plan: RotationPlan, fold: tuple[float, float] | None,
                      layer: int) -> dict[str, torch.Tensor]:
    """Full names -> one layer's attention tensors rotated (then scale-folded, see quant/fold.py),
    only those that change. fold: this layer's (f_k, f_v) from fold.fold_plan, or None."""
    prefix = f"model.layers.{layer}.self_attn."
    local = {k[len(prefix):]: reader.copy_and_drop(k) for k in reader.weight_map
             if k.startswith(prefix) and not is_kv_scale_name(k)}
    changed = plan.apply(layer, local, layout.num_heads) if not plan.is_identity else {}
    if fold is not None:
        changed.update(fold_layer({**local, **changed}, layout, *fold))
    return {prefix + name: tensor for name, tensor in changed.items()}


def fold_report(scales: KVScales) -> tuple[list[tuple[float, float]], KVScales, dict]:
    """(per-layer (f_k, f_v), the remaining scales written under every name, the report entry)."""
    factors, remaining = fold_plan(scales)
    entry = {"rule": "weights producing the cache / f, weights reading it * f, f = 2^ceil(log2 scale); "
                     "written scales = calibrated / f",
             "f_k": [fk for fk, _ in factors], "f_v": [fv for _, fv in factors], "written_scales": remaining.to_json()}
    return factors, remaining, entry


_LAYER_ATTENTION = re.compile(r"^model\.layers\.(\d+)\.self_attn\.")


def _export_tensors(reader, layout: KVShape, plan: RotationPlan, factors):
    """(name, tensor) for every weight, in the reader's order, one layer's changes in memory at a
    time; each tensor read is copied out of its pages and the pages are dropped (a 7B export's
    RSS stays near one shard, not the whole checkpoint)."""
    cached_layer, changed = None, {}
    for name in reader.weight_map:
        if is_kv_scale_name(name):
            continue  # an earlier calibration's scales are replaced
        m = _LAYER_ATTENTION.match(name)
        if m is not None and int(m.group(1)) != cached_layer:
            cached_layer = int(m.group(1))
            changed = changed_attention(reader, layout, plan, factors[cached_layer], cached_layer)
        yield name, changed[name] if name in changed else reader.copy_and_drop(name)


def plot_scales(scales: KVScales, path: Path, title: str) -> None:
    """PNG of per-layer k/v scales (log scale; one faint line per head when per head)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(range(scales.num_layers))
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    kinds = [("k", scales.k, "tab:blue")] + ([] if scales.layout_kind == MLA else [("v", scales.v, "tab:orange")])
    for name, values, color in kinds:
        stacked = torch.stack([s.reshape(-1) for s in values])  # [layers, heads]
        label = "row scale (latent|k_rope)" if scales.layout_kind == MLA else f"{name}_scale"
        if stacked.shape[1] > 1:
            for h in range(stacked.shape[1]):
                ax.plot(layers, stacked[:, h], color=color, alpha=0.35, lw=1)
        ax.plot(layers, stacked.amax(1), color=color, marker="o", ms=3, label=label + (" (max over heads)" if stacked.shape[1] > 1 else ""))
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel(f"scale (amax / {kv_format(scales.kv_dtype).amax_divisor:g})")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


# files a calibrated checkpoint gets anew; every other regular file of the source is carried over
# (generation_config.json, conversion/heal reports and their pictures, ...)
EXPORT_SHARD_BYTES = 256 << 20  # the writer buffers a shard (and serializes it once more): 2 x this, as mla
_REWRITTEN = ("config.json", "manifest.json", "hf_quant_config.json", "calibration_report.json", "kv_scales.png",
              "model.safetensors.index.json")


def write_checkpoint(src_dir: Path, out_dir: Path, layout: KVShape, scales: KVScales | None, plan: RotationPlan,
                     formats: tuple[str, ...], report: dict, overwrite: bool = False) -> Path:
    """New checkpoint at out_dir (atomic, via CheckpointWriter): weights copied or rotated and folded,
    the scales, and the source's other files. out_dir may be src_dir itself (--in-place): the new
    folder is built beside it and swapped in at the end, so a failure leaves the source untouched.
    scales None (llama.cpp's types): the rotated weights and the report only."""
    from kvconvert.checkpoint import CheckpointReader, CheckpointWriter

    reader = CheckpointReader(src_dir)
    if scales is None:
        factors, new_scales = [None] * layout.num_layers, {}
    else:
        factors, remaining, folding = fold_report(scales)
        report = {**report, "scale_folding": folding}
        new_scales = scale_tensors(remaining, layout, formats)
    calibration = {"kv_dtype": report["kv_dtype"], "formats": list(formats)}
    with CheckpointWriter(out_dir, overwrite=overwrite, source=str(src_dir), max_shard_bytes=EXPORT_SHARD_BYTES,
                          manifest_extra={"kv_calibration": calibration}) as w:
        for name, tensor in _export_tensors(reader, layout, plan, factors):
            w.add(name, tensor)
        for name, tensor in new_scales.items():
            w.add(name, tensor)
        w.write_config(output_config(reader.config, scales, formats) if scales is not None else
                       {k: v for k, v in reader.config.items() if k != "quantization_config"})
        tokenizer = w.copy_tokenizer(src_dir)
        _carry_other_files(Path(src_dir), w, skip=set(tokenizer))
        if "modelopt" in formats and kv_format(scales.kv_dtype).modelopt_algo:  # nvfp4_fp8rope: no ModelOpt algo
            w.write_json("hf_quant_config.json", hf_quant_config(scales))
        w.write_json("calibration_report.json", report)
        if scales is None:
            return out_dir
        with tempfile.TemporaryDirectory() as tmp:
            png = Path(tmp) / "kv_scales.png"
            plot_scales(scales, png, _title(report))
            w.copy_file(png, "kv_scales.png")
    return out_dir


def _carry_other_files(src_dir: Path, writer, skip: set[str]) -> None:
    for path in sorted(src_dir.iterdir()):
        if (path.is_file() and not path.name.startswith(".") and path.name not in skip
                and path.name not in _REWRITTEN and path.suffix != ".safetensors"):
            writer.copy_file(path)


def _title(report: dict) -> str:
    return (f"{Path(str(report.get('source', ''))).name}: {report['kv_dtype']} KV scales, observer "
            f"{report['observer']}, {report['granularity']}, {report['calibration']['tokens']} tokens")
