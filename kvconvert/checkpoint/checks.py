"""Checks every command runs on a model folder before any expensive work (one source of truth).

    check_checkpoint(path)   files + index, config features, expected tensors, tokenizer files,
                             finite weights, in that order

- Config: `models.registry.check_supported_features` (sliding windows, soft-capping, qk-norm...):
  refused on every path, so nothing converts or runs silently as something else.
- Tensors: the names config.json implies (Llama / DeepSeek-V3 layouts, biases when
  attention_bias / mlp_bias say so, lm_head unless tied) against the safetensors index or header.
  A missing tensor is named with the file where it should be; transformers would otherwise fill it
  with random values and the runtime would fail later with a bare KeyError.
- Tokenizer: a vocabulary file (kvconvert.checkpoint.reader.TOKENIZER_VOCAB_FILES) by name, so a
  folder without one is refused before work, not by transformers after the conversion started.
- Weights: every floating tensor is read once and its min/max taken (see `_all_finite`), so a NaN
  or inf is found before hours of conversion, not when the conversion reaches its layer.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvconvert.checkpoint.reader import INDEX_NAME, SINGLE_NAME, CheckpointReader, check_tokenizer_files
from kvconvert.checkpoint.writer import _all_finite
from kvconvert.errors import CheckpointError
from kvconvert.models import registry

_LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")


def _layer_names_llama(cfg: dict, i: int) -> dict[str, str]:
    """{tensor name: why config.json requires it} for one Llama-family layer."""
    names = {n.format(i=i): "every layer" for n in registry.SOURCE_ATTENTION.values()}
    names.update({n.format(i=i): "every layer" for n in registry.COPIED_LAYER_TENSORS})
    if cfg.get("attention_bias"):
        names.update({n.format(i=i).replace(".weight", ".bias"): "attention_bias is true"
                      for n in registry.SOURCE_ATTENTION.values()})
    if cfg.get("mlp_bias"):
        names.update({f"model.layers.{i}.mlp.{p}.bias": "mlp_bias is true" for p in _LLAMA_MLP})
    return names


def _layer_names_deepseek(cfg: dict, i: int) -> dict[str, str]:
    """One DeepSeek-V3 layer: MLA attention, norms, and the MLP of dense layers (MoE layers'
    experts are not listed: no kvconvert path reads them)."""
    q = ("q_a_proj", "q_a_layernorm", "q_b_proj") if cfg.get("q_lora_rank") else ("q_proj",)
    parts = (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    names = {registry.TARGET_ATTENTION[p].format(i=i): "every layer" for p in parts}
    norms = ("input_layernorm", "post_attention_layernorm")
    names.update({f"model.layers.{i}.{n}.weight": "every layer" for n in norms})
    if i < cfg.get("first_k_dense_replace", cfg["num_hidden_layers"]):
        names.update({f"model.layers.{i}.mlp.{p}.weight": "dense layers" for p in _LLAMA_MLP})
    return names


def expected_tensors(cfg: dict) -> dict[str, str] | None:
    """{tensor name: why it is required} for the architectures kvconvert reads; None for others
    (their own checks refuse them)."""
    if cfg.get("kv_lora_rank") is not None and cfg.get("model_type") == "deepseek_v3":
        layer = _layer_names_deepseek
    elif cfg.get("model_type") in registry.SOURCE_MODEL_TYPES:  # Llama family
        layer = _layer_names_llama
    else:
        return None
    names = {"model.embed_tokens.weight": "always", "model.norm.weight": "always"}
    if cfg.get("tie_word_embeddings") is not True:
        names["lm_head.weight"] = "tie_word_embeddings is not true"
    for i in range(cfg["num_hidden_layers"]):
        names.update(layer(cfg, i))
    return names


def _where(reader: CheckpointReader, name: str) -> Path:
    """The file a missing tensor should be in: the single file, else the shard holding its
    nearest neighbours (same module, else same layer), else the index."""
    if not (reader.path / INDEX_NAME).is_file():
        return reader.path / SINGLE_NAME
    parts = name.split(".")
    for keep in range(len(parts) - 1, 2, -1):  # model.layers.1.mlp.up_proj -> ... -> model.layers.1
        prefix = ".".join(parts[:keep]) + "."
        shard = next((f for key, f in reader.weight_map.items() if key.startswith(prefix)), None)
        if shard is not None:
            return reader.path / shard
    return reader.path / INDEX_NAME


def check_tensors_present(reader: CheckpointReader) -> None:
    """Every tensor config.json implies is in the checkpoint, else a one-line error naming it."""
    expected = expected_tensors(reader.config) or {}
    missing = [n for n in expected if n not in reader.weight_map]
    if not missing:
        return
    name = missing[0]
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise CheckpointError(
        f"{_where(reader, name)}: tensor {name!r} is missing{more}; config.json requires it ({expected[name]}). "
        "Re-export or re-download the checkpoint, or fix config.json if it declares what the model does not have")


def _scan_view(reader: CheckpointReader, name: str) -> torch.Tensor:
    """The tensor as a view of its file pages (no copy); a copy for dtypes torch cannot map."""
    try:
        return reader.mapped(name)
    except CheckpointError:
        return reader.get(name)


def check_finite_weights(reader: CheckpointReader, names: list[str] | None = None) -> float:
    """Read every floating tensor once and refuse NaN/inf, naming the tensor and its file.
    Returns the seconds it took (about the time to read the files once)."""
    t0 = time.perf_counter()
    try:
        for name in names if names is not None else reader.keys():
            tensor = _scan_view(reader, name)
            if tensor.is_floating_point() and not _all_finite(tensor):
                raise CheckpointError(
                    f"{reader.path / reader.weight_map[name]}: tensor {name!r} contains NaN or inf; the checkpoint "
                    "is broken: re-download or re-export it")
            del tensor
            reader.drop_pages(name)  # peak RSS: one tensor's pages, not the checkpoint's
    finally:
        reader.close()  # drop the mapped pages the scan touched
    return time.perf_counter() - t0


def check_checkpoint(src: str | Path | CheckpointReader, finite: bool = True, tokenizer: bool = True) -> None:
    """All up-front checks on a model folder: files intact and the index agreeing with the shards
    (CheckpointReader), config features, expected tensors, tokenizer files, finite weights."""
    reader = src if isinstance(src, CheckpointReader) else CheckpointReader(src)
    registry.check_supported_features(reader.config, str(reader.path / "config.json"))
    check_tensors_present(reader)
    if tokenizer and expected_tensors(reader.config) is not None:  # other architectures: their own refusal first
        check_tokenizer_files(reader.path)
    if finite:
        check_finite_weights(reader)
