"""Foundation commands: `kvconvert inspect`, `budget`, `fetch`, `import-gguf`.

`inspect` and `budget` read only config.json and safetensors headers (no weights, no torch), so
they answer in well under a second even for a 400B-parameter folder.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import click

from kvconvert import kvmath
from kvconvert.errors import CheckpointError, KVConvertError, UnsupportedModelError
from kvconvert.presets import PRESETS, get_preset

INSPECT_DTYPES = ("bf16", "fp8", "nvfp4")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


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
    notes: list[str] = field(default_factory=list)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


from kvconvert.st_header import safetensors_header  # noqa: E402  (torch-free)


def weight_files(folder: Path) -> list[Path]:
    """Safetensors files of an HF folder (index shards or model.safetensors); [] when it has none."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            shards = sorted(set(_read_json(index)["weight_map"].values()))
        except (KeyError, AttributeError, TypeError):
            raise CheckpointError(f"{index}: index has no weight_map") from None
        for shard in shards:
            if not (folder / shard).is_file():
                raise CheckpointError(f"{folder / shard}: shard named in {INDEX_NAME} is missing")
        return [folder / s for s in shards]
    return [folder / SINGLE_NAME] if (folder / SINGLE_NAME).is_file() else []


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
        for meta in safetensors_header(path).values():
            numel = math.prod(meta["shape"])
            info.tensor_dtypes[meta["dtype"]] = info.tensor_dtypes.get(meta["dtype"], 0) + numel
            total += numel
    info.parameters, info.parameters_source = total, "safetensors headers"
    info.weights_bytes = sum(p.stat().st_size for p in files)
    if any(d in info.tensor_dtypes for d in ("U8", "I8", "F4", "F8_E4M3", "F8_E5M2")):
        info.notes.append("quantized tensors present: packed elements and scales are counted as stored")


def _parameters_from_config(info: ModelInfo) -> None:
    try:
        info.parameters, info.parameters_source = kvmath.parameter_count(info.config), "config"
    except UnsupportedModelError as exc:
        info.notes.append(str(exc))


def _from_folder(name: str, folder: Path) -> ModelInfo:
    info = ModelInfo(name=name, config=_read_json(folder / "config.json"), path=folder.resolve())
    _add_weight_stats(info)
    return info


def _from_config_file(path: Path) -> ModelInfo:
    info = ModelInfo(name=str(path), config=_read_json(path), origin="config")
    _parameters_from_config(info)
    return info


def _from_preset(name: str) -> ModelInfo:
    preset = get_preset(name)
    return ModelInfo(name=name.lower(), config=dict(preset["config"]), origin="preset",
                     parameters=preset["parameters"], parameters_source="preset",
                     notes=[f"preset from {preset['source']}"])


def load_model(src: str, prefer_preset: bool) -> ModelInfo:
    """Resolve SRC: a config.json file, a folder, a preset name, a built-in model or a hub id.

    `prefer_preset`: a name that is both a preset and a built-in model (smollm2-135m) is taken as
    the preset (budget: no download) instead of the local folder (inspect).
    """
    from kvconvert.sources import BUILTIN_MODELS, resolve_source

    path = Path(src).expanduser()
    if path.is_file() and path.suffix == ".json":
        return _from_config_file(path)
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


def inspect_report(info: ModelInfo) -> dict:
    """Everything `inspect` reports, JSON-ready. Unknown architectures report what they can."""
    report = {"name": info.name, "path": str(info.path) if info.path else None, "origin": info.origin,
              **_architecture_fields(info.config)}
    notes = list(info.notes)
    try:
        report["attention_kind"] = kvmath.attention_kind(info.config)
        shape = kvmath.kv_shape(info.config)
    except UnsupportedModelError as exc:
        report.setdefault("attention_kind", None)
        shape = None
        notes.append(f"KV cache size unknown: {exc}")
    report["kv_values_per_token_per_layer"] = shape.values_per_token_per_layer if shape else None
    report["kv_bytes_per_token"] = {d: kvmath.kv_bytes_per_token(shape, d) for d in INSPECT_DTYPES} if shape else {}
    windows = kvmath.layer_windows(info.config) if shape else []
    if any(w is not None for w in windows):
        report["sliding_window"] = max(w for w in windows if w is not None)
        notes.append(f"{sum(w is not None for w in windows)} of {len(windows)} layers use a sliding window")
    if kvmath.text_config(info.config).get("attention_bias") or info.config.get("model_type") == "qwen2":
        notes.append("attention projections have biases")
    from kvconvert.mla.deepseek_format import unsupported_features  # torch-free; the check every command runs

    notes += [f"not supported by kvconvert (mla, calibrate, generate and validate refuse it): {f}"
              for f in unsupported_features(info.config)]
    quant = info.config.get("quantization_config")
    report["quantization"] = quant.get("quant_method") if isinstance(quant, dict) else None
    report.update(parameters=info.parameters, parameters_source=info.parameters_source,
                  weights_bytes=info.weights_bytes, tensor_dtypes=info.tensor_dtypes, notes=notes)
    return report


def _human_inspect(r: dict) -> str:
    lines = [f"model         {r['name']}" + (f"  ({r['path']})" if r["path"] else f"  ({r['origin']})"),
             f"architecture  {r['architecture']} (model_type {r['model_type']})"]
    if r["attention_kind"] == kvmath.MLA:
        lines.append(f"attention     MLA: {r['num_hidden_layers']} layers, {r['num_attention_heads']} heads, "
                     f"kv_lora_rank {r['kv_lora_rank']}, qk_rope_head_dim {r['qk_rope_head_dim']}")
    elif r["attention_kind"]:
        lines.append(f"attention     {r['attention_kind']}: {r['num_hidden_layers']} layers, "
                     f"{r['num_attention_heads']} heads, {r['num_key_value_heads'] or r['num_attention_heads']} KV heads, "
                     f"head_dim {r['head_dim']}")
    if r["parameters"] is not None:
        disk = f"; {kvmath.format_bytes(r['weights_bytes'])} on disk" if r["weights_bytes"] else ""
        dtypes = f", {'/'.join(sorted(r['tensor_dtypes']))}" if r["tensor_dtypes"] else ""
        lines.append(f"parameters    {r['parameters']:,} (from {r['parameters_source']}{dtypes}{disk})")
    if r["kv_bytes_per_token"]:
        per = ", ".join(f"{d} {b:,} B" for d, b in r["kv_bytes_per_token"].items())
        lines.append(f"KV per token  {per}  ({r['kv_values_per_token_per_layer']} values/layer; "
                     "nvfp4 includes its E4M3 block scales)")
    lines += [f"note          {n}" for n in r["notes"]]
    return "\n".join(lines)


@click.command("inspect")
@click.argument("src")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of text.")
def inspect_cmd(src, as_json):
    """Describe a model: architecture, attention kind, heads, parameters, KV bytes per token.

    SRC: a Hugging Face folder, a config.json, a built-in model (smollm2-135m), a preset
    (see `kvconvert budget --help`) or a hub id. Reads headers only, never the weights.
    """
    report = inspect_report(load_model(src, prefer_preset=False))
    click.echo(json.dumps(report, indent=2) if as_json else _human_inspect(report))


# ----------------------------------------------------------------------------------------------
# budget
# ----------------------------------------------------------------------------------------------


def budget_report(info: ModelInfo, context: int | None, batch: int, kv_dtype: str, mla_rank: int | None,
                  rope_dim: int | None, gpu_mem: str | None, weights_dtype: str) -> dict:
    """KV bytes per token / request / batch and, with gpu_mem, how many requests fit."""
    fmt, config = kvmath.kv_format(kv_dtype), info.config
    shape = kvmath.kv_shape(config)
    if context is None:
        context = kvmath.text_config(config).get("max_position_embeddings")
        if not context:
            raise KVConvertError("the config has no max_position_embeddings; pass --context N")
    if batch <= 0:
        raise KVConvertError(f"--batch must be positive, got {batch}")
    report = {"model": info.name, "origin": info.origin, "attention_kind": shape.kind, "kv_dtype": fmt.name,
              "bytes_per_value": fmt.bytes_per_value, "context": context, "batch": batch}
    windows = kvmath.layer_windows(config)
    if mla_rank is not None:
        report["original_bytes_per_token"] = kvmath.kv_bytes_per_token(shape, fmt)
        shape, windows = kvmath.mla_whatif(shape, mla_rank, rope_dim), [None] * shape.num_layers
        report["mla_whatif"] = {"kv_lora_rank": mla_rank, "qk_rope_head_dim": rope_dim}
    report["values_per_token_per_layer"] = shape.values_per_token_per_layer
    report["bytes_per_token"] = kvmath.kv_bytes_per_token(shape, fmt)
    report["bytes_per_request"] = kvmath.kv_bytes_per_request(shape, fmt, context, windows)
    report["bytes_total"] = report["bytes_per_request"] * batch
    notes = list(info.notes)
    if any(w is not None for w in windows):
        notes.append("sliding-window layers keep at most their window of tokens")
    if fmt.name == "nvfp4":
        naive = report["bytes_per_request"] * 0.5 / fmt.bytes_per_value
        notes.append("nvfp4 counts its block scales: 0.5625 bytes/value (4-bit values + one E4M3 scale per 16 "
                     "values; the fp32 global scale is negligible). The commonly quoted 0.5 byte/value ignores "
                     f"the block scales and would say {kvmath.format_bytes(naive)} per request.")
    if fmt.name == "int4":
        notes.append("int4 counted as symmetric 4-bit values + one fp16 scale per group of 32 (0.5625 bytes/value)")
    if gpu_mem is not None:
        report.update(_fit(info, report, gpu_mem, weights_dtype, notes))
    report["notes"] = notes
    return report


def _fit(info: ModelInfo, report: dict, gpu_mem: str, weights_dtype: str, notes: list[str]) -> dict:
    if info.parameters is None:
        raise KVConvertError(f"{info.name}: parameter count unknown (no weights, config not countable); "
                             "cannot place the weights on --gpu-mem")
    wfmt = kvmath.kv_format(weights_dtype)
    gpu_bytes = kvmath.parse_size(gpu_mem)
    weights_bytes = math.ceil(info.parameters * wfmt.bytes_per_value)
    free = gpu_bytes - weights_bytes
    notes.append("activations, CUDA graphs and allocator overhead are not counted: leave headroom")
    return {"gpu_mem_bytes": gpu_bytes, "weights_dtype": wfmt.name, "parameters": info.parameters,
            "weights_bytes": weights_bytes, "kv_budget_bytes": max(free, 0),
            "requests_fit": max(free, 0) // report["bytes_per_request"],
            "batch_fits": free >= report["bytes_total"]}


def _human_budget(r: dict) -> str:
    f = kvmath.format_bytes
    lines = [f"model        {r['model']} ({r['origin']}), {r['attention_kind']} attention",
             f"KV dtype     {r['kv_dtype']} ({r['bytes_per_value']:g} bytes/value)"]
    if "mla_whatif" in r:
        w = r["mla_whatif"]
        lines.append(f"MLA what-if  kv_lora_rank {w['kv_lora_rank']} + rope {w['qk_rope_head_dim']}: "
                     f"{r['original_bytes_per_token']:,} -> {r['bytes_per_token']:,} bytes/token "
                     f"({r['original_bytes_per_token'] / r['bytes_per_token']:.2f}x smaller)")
    lines += [f"per token    {r['bytes_per_token']:,} bytes ({f(r['bytes_per_token'])})",
              f"per request  {r['context']:,} tokens: {r['bytes_per_request']:,} bytes ({f(r['bytes_per_request'])})",
              f"total        batch {r['batch']}: {r['bytes_total']:,} bytes ({f(r['bytes_total'])})"]
    if "requests_fit" in r:
        lines += [f"weights      {r['parameters']:,} params in {r['weights_dtype']}: {f(r['weights_bytes'])}",
                  f"GPU memory   {f(r['gpu_mem_bytes'])}: {f(r['kv_budget_bytes'])} left for the KV cache",
                  f"fits         {r['requests_fit']} concurrent requests of {r['context']:,} tokens"
                  f" (batch {r['batch']}: {'yes' if r['batch_fits'] else 'no'})"]
    lines += [f"note         {n}" for n in r["notes"]]
    return "\n".join(lines)


@click.command("budget")
@click.option("--model", "model", required=True, help=f"Preset ({', '.join(PRESETS)}), HF folder or config.json.")
@click.option("--context", type=int, default=None, help="Tokens per request [default: max_position_embeddings].")
@click.option("--batch", type=int, default=1, show_default=True, help="Concurrent requests.")
@click.option("--kv-dtype", default="bf16", show_default=True,
              type=click.Choice(list(kvmath.KV_FORMATS), case_sensitive=False), help="KV-cache format.")
@click.option("--mla-rank", type=int, default=None, help="What-if: convert to MLA with this kv_lora_rank.")
@click.option("--rope-dim", type=int, default=None, help="What-if: shared RoPE key dims [default with --mla-rank: 64].")
@click.option("--gpu-mem", default=None, help="GPU memory, e.g. 80GiB or 141GB: how many requests fit beside the weights.")
@click.option("--weights-dtype", default="bf16", show_default=True,
              type=click.Choice(list(kvmath.KV_FORMATS), case_sensitive=False), help="Weight format for --gpu-mem.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of text.")
def budget_cmd(model, context, batch, kv_dtype, mla_rank, rope_dim, gpu_mem, weights_dtype, as_json):
    """KV-cache memory for a model, context and batch; optionally an MLA what-if and a GPU fit."""
    if rope_dim is not None and mla_rank is None:
        raise KVConvertError("--rope-dim needs --mla-rank (the what-if MLA latent size)")
    if mla_rank is not None and rope_dim is None:
        rope_dim = 64  # DeepSeek-V2/V3's qk_rope_head_dim
    info = load_model(model, prefer_preset=True)
    report = budget_report(info, context, batch, kv_dtype, mla_rank, rope_dim, gpu_mem, weights_dtype)
    click.echo(json.dumps(report, indent=2) if as_json else _human_budget(report))


# ----------------------------------------------------------------------------------------------
# fetch, import-gguf
# ----------------------------------------------------------------------------------------------


@click.command("fetch")
@click.argument("name", required=False, default="smollm2-135m")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
def fetch_cmd(name, dtype):
    """Put a built-in model (default smollm2-135m) into the cache and print its folder."""
    from kvconvert.sources import BUILTIN_MODELS, resolve_source

    if name.lower() not in BUILTIN_MODELS and "/" not in name:
        raise KVConvertError(f"{name}: not a built-in model; built-in: {', '.join(sorted(BUILTIN_MODELS))}")
    click.echo(str(resolve_source(name, dtype=dtype)))


@click.command("import-gguf")
@click.argument("gguf_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output folder (HF format, safetensors).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
def import_gguf_cmd(gguf_file, out_dir, dtype, overwrite):
    """Dequantize a GGUF file into a Hugging Face safetensors folder (config, weights, tokenizer)."""
    from kvconvert.checkpoint.gguf_import import import_gguf  # refuses an existing --out before loading

    click.echo(str(import_gguf(gguf_file, out_dir, dtype=dtype, overwrite=overwrite)))
