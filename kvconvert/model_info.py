"""What a model is, read from config.json and safetensors headers only (no weights, no torch): what
`kvconvert inspect` prints (kvconvert.commands.inspect), well under a second even for a 400B-parameter
folder. ModelInfo / load_model_info are shared with `kvconvert budget` (kvconvert.budget)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from kvconvert import kvmath
from kvconvert.errors import KVConvertError, UnsupportedModelError
from kvconvert.kvformat import INSPECT_KV_DTYPES, INSPECT_LLAMACPP_KV_DTYPES
from kvconvert.presets import PRESETS, get_preset
from kvconvert.st_header import read_json_object, safetensors_header, weight_files

# ----------------------------------------------------------------------------------------------
# model sources: a folder, a config.json, or a preset
# ----------------------------------------------------------------------------------------------


@dataclass
class ModelInfo:
    """A model's config plus what its weights' headers say (folders only)."""

    name: str
    config: dict
    path: Path | None = None  # resolved local folder (None for presets and bare config files)
    origin: str = "folder"  # folder | preset | config
    parameters: int | None = None
    parameters_source: str | None = None  # safetensors headers | preset | config
    weights_bytes: int | None = None
    tensor_dtypes: dict[str, int] = field(default_factory=dict)  # safetensors dtype -> elements
    tensor_shapes: dict[str, list[int]] = field(default_factory=dict)  # tensor name -> shape, from the headers
    notes: list[str] = field(default_factory=list)


def _read_json(path: Path) -> dict:
    return read_json_object(path, path.name)


def _add_weight_stats(info: ModelInfo) -> None:
    files = weight_files(info.path)
    if not files:
        if list(info.path.glob("*.bin")) or list(info.path.glob("*.pt")):
            info.notes.append("only pickle weights (.bin/.pt): kvconvert reads safetensors only")
        else:
            info.notes.append("no safetensors weights in the folder")
        _parameters_from_config(info)
        return
    total = 0
    for path in files:
        for name, meta in safetensors_header(path).items():
            info.tensor_shapes[name] = meta["shape"]
            numel = math.prod(meta["shape"])
            info.tensor_dtypes[meta["dtype"]] = info.tensor_dtypes.get(meta["dtype"], 0) + numel
            total += numel
    info.parameters, info.parameters_source = total, "safetensors headers"
    info.weights_bytes = sum(p.stat().st_size for p in files)
    if any(d in info.tensor_dtypes for d in ("U8", "I8", "F4", "F8_E4M3", "F8_E5M2")):
        info.notes.append("quantized tensors present: packed elements and scales are counted as stored")


def _parameters_from_config(info: ModelInfo) -> ModelInfo:
    """`info` with its parameter count from the config, or a note saying why there is none."""
    try:
        info.parameters, info.parameters_source = kvmath.parameter_count(info.config), "config"
    except UnsupportedModelError as exc:
        info.notes.append(str(exc))
    return info


def _from_folder(name: str, folder: Path) -> ModelInfo:
    info = ModelInfo(name=name, config=_read_json(folder / "config.json"), path=folder.resolve())
    _add_weight_stats(info)
    return info


def _from_preset(name: str) -> ModelInfo:
    preset = get_preset(name)
    return ModelInfo(name=name.lower(), config=dict(preset["config"]), origin="preset",
                     parameters=preset["parameters"], parameters_source="preset",
                     notes=[f"preset from {preset['source']}"])


def load_model_info(src: str, prefer_preset: bool) -> ModelInfo:
    """Resolve SRC: a config.json file, a folder, a preset name, a built-in model or a hub id.

    `prefer_preset`: a name that is both a preset and a built-in model (smollm2-135m) is taken as
    the preset (budget: no download) instead of the local folder (inspect).
    """
    from kvconvert.sources import BUILTIN_MODELS, resolve_source

    path = Path(src).expanduser()
    if path.is_file() and path.suffix == ".json":
        return _parameters_from_config(ModelInfo(name=str(path), config=_read_json(path), origin="config"))
    if path.exists():
        return _from_folder(src, resolve_source(path))
    name = src.lower()
    if name in PRESETS and (prefer_preset or name not in BUILTIN_MODELS):
        return _from_preset(name)
    if name in BUILTIN_MODELS or ("/" in src and not src.startswith((".", "/"))):
        return _from_folder(src, resolve_source(src))
    known = ", ".join(sorted(set(PRESETS) | set(BUILTIN_MODELS)))
    raise KVConvertError(f"{src}: no such folder or config.json, and not a known model; known: {known}")


# ----------------------------------------------------------------------------------------------
# inspect
# ----------------------------------------------------------------------------------------------


def _architecture_fields(config: dict) -> dict:
    cfg = kvmath.text_config(config)
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "intermediate_size", "max_position_embeddings", "tie_word_embeddings",
            "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    fields = {k: cfg.get(k) for k in keys}
    fields["head_dim"] = kvmath.head_dim(cfg) if not cfg.get("kv_lora_rank") else None
    architectures = config.get("architectures") or [None]
    return {"architecture": architectures[0], "model_type": config.get("model_type"), **fields}


K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # [KV heads x head_dim, hidden] in a Llama-family checkpoint


def config_as_stored(info: ModelInfo) -> tuple[dict, str | None]:
    """(the config with the KV heads its weights hold, a note) where config.json's num_key_value_heads (or its
    absence: transformers then takes num_attention_heads) disagrees with layer 0's k_proj in the safetensors
    headers; (the config, None) where they agree or cannot be compared. A config without num_key_value_heads over
    a GQA checkpoint would otherwise be reported as MHA with twice (or more) its KV bytes."""
    cfg = info.config
    shape, d = info.tensor_shapes.get(K_PROJ), kvmath.head_dim(cfg)
    if kvmath.text_config(cfg) is not cfg or cfg.get("kv_lora_rank") is not None or shape is None:
        return cfg, None
    stated = cfg.get("num_key_value_heads")  # 0 is stated (and wrong), not missing
    held, says = kvmath.kv_heads_held(cfg, shape), cfg.get("num_attention_heads") if stated is None else stated
    if held is None or held == says:
        return cfg, None
    given = (f"says num_key_value_heads {json.dumps(stated)}" if stated is not None
             else f"has no num_key_value_heads (transformers then takes num_attention_heads, {says})")
    return {**cfg, "num_key_value_heads": held}, (
        f"config.json {given}, but {K_PROJ} is {shape} = {held} KV heads x head_dim {d}: the KV figures above are "
        f"the weights' ({held} KV heads); set \"num_key_value_heads\": {held} in config.json (kvconvert's other "
        "commands refuse the folder until config.json and its weights agree)")


def _refusal(info: ModelInfo) -> str | None:
    """What mla, calibrate, generate and validate would refuse in this folder, by the same checks (config fields,
    tensors present, their shapes from the safetensors headers; kvconvert.checkpoint.checks), or None. inspect
    still describes what it can."""
    from kvconvert.checkpoint import CheckpointReader
    from kvconvert.checkpoint.checks import check_config, check_tensor_shapes, check_tensors_present

    if info.path is None:
        return None
    try:
        check_config(info.config, str(info.path / "config.json"))
        reader = CheckpointReader(info.path)
        check_tensors_present(reader)
        check_tensor_shapes(reader)
    except KVConvertError as exc:
        return str(exc)
    return None


def inspect_report(info: ModelInfo) -> dict:
    """Everything `inspect` reports, JSON-ready. Unknown architectures report what they can; KV heads and bytes
    follow the weights where config.json disagrees with them (config_as_stored, with a note)."""
    config, mismatch = config_as_stored(info)
    report = {"name": info.name, "path": str(info.path) if info.path else None, "origin": info.origin,
              **_architecture_fields(config)}
    notes = list(info.notes) + ([mismatch] if mismatch else [])
    refusal = _refusal(info)
    if refusal:
        notes.append(f"kvconvert's other commands refuse this folder: {refusal}")
    try:
        report["attention_kind"] = kvmath.attention_kind(config)
        shape = kvmath.kv_shape(config)
    except UnsupportedModelError as exc:
        report.setdefault("attention_kind", None)
        shape = None
        notes.append(f"KV cache size unknown: {exc}")
    report["kv_values_per_token_per_layer"] = shape.values_per_token_per_layer if shape else None
    report["kv_bytes_per_token"] = {d: kvmath.kv_bytes_per_token(shape, d) for d in INSPECT_KV_DTYPES} if shape else {}
    report["llamacpp_kv_bytes_per_token"] = _llamacpp_bytes(config, shape, notes) if shape else {}
    windows = kvmath.layer_windows(info.config) if shape else []
    if any(w is not None for w in windows):
        report["sliding_window"] = max(w for w in windows if w is not None)
        notes.append(f"{sum(w is not None for w in windows)} of {len(windows)} layers use a sliding window")
    if kvmath.text_config(info.config).get("attention_bias") or info.config.get("model_type") == "qwen2":
        notes.append("attention projections have biases")
    from kvconvert.models.registry import unsupported_features  # torch-free; the check every command runs

    notes += [f"not supported by kvconvert (mla, calibrate, generate and validate refuse it): {f}"
              for f in unsupported_features(info.config)]
    quant = info.config.get("quantization_config")
    report["quantization"] = quant.get("quant_method") if isinstance(quant, dict) else None
    report.update(parameters=info.parameters, parameters_source=info.parameters_source,
                  weights_bytes=info.weights_bytes, tensor_dtypes=info.tensor_dtypes, notes=notes)
    return report


def _llamacpp_bytes(config: dict, shape, notes: list[str]) -> dict[str, int]:
    """KV bytes per token in llama.cpp's cache types (INSPECT_LLAMACPP_KV_DTYPES, keys and values apart), {} with
    a note when llama.cpp cannot serve the shape quantized; an MLA row is one type (no K/V pair)."""
    from kvconvert.kvformat import kv_pair
    from kvconvert.targets import llamacpp_config_problem

    problem = llamacpp_config_problem(config)
    if problem:
        notes.append(f"llama.cpp serves this model with a 16-bit cache only: {problem}")
        return {}
    return {d: kvmath.kv_bytes_per_token(shape, d) for d in INSPECT_LLAMACPP_KV_DTYPES
            if not (shape.is_mla and kv_pair(d).mixed)}
