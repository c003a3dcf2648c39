"""Checks every command runs on a model folder before any expensive work (one source of truth).

    check_checkpoint(path)   files + index, config fields, config features, expected tensors, tensor
                             shapes, tokenizer files, finite weights, in that order

- Config fields: the integers the tensor shapes follow from (hidden_size, num_hidden_layers, heads,
  ... for Llama; the latent sizes for DeepSeek-V3) are positive integers (`check_config`), so a
  missing or mistyped field is named, not a KeyError / TypeError deep in a command.
- Config: `models.registry.check_supported_features` (sliding windows, soft-capping, qk-norm...):
  refused on every path, so nothing converts or runs silently as something else.
- Tensors: the names config.json implies (Llama / DeepSeek-V3 layouts, biases when
  attention_bias / mlp_bias say so, lm_head unless tied) against the safetensors index or header.
  A missing tensor is named with the file where it should be; transformers would otherwise fill it
  with random values and the runtime would fail later with a bare KeyError.
- Shapes: every tensor of the architecture (embeddings, norms, attention, MLP, biases) against the
  shape config.json implies (`expected_shapes`), from the safetensors headers (no data read): a
  transposed or reshaped tensor, or a config that disagrees with its weights (num_key_value_heads
  missing, so transformers' default num_attention_heads, while k_proj holds fewer heads), is named
  with its file instead of a shape error in the middle of a conversion.
- Tokenizer: a vocabulary file (kvconvert.checkpoint.reader.TOKENIZER_VOCAB_FILES) by name, so a
  folder without one is refused before work, not by transformers after the conversion started.
- Weights: every floating tensor is read once and its min/max taken (see `_all_finite`), so a NaN
  or inf is found before hours of conversion, not when the conversion reaches its layer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from kvconvert.checkpoint.reader import INDEX_NAME, SINGLE_NAME, CheckpointReader, check_tokenizer_files
from kvconvert.checkpoint.writer import _all_finite
from kvconvert.errors import CheckpointError
from kvconvert.kvmath import head_dim, kv_heads_held
from kvconvert.models import registry
from kvconvert.st_header import safetensors_header

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
    if i < _dense_layers(cfg):
        names.update({f"model.layers.{i}.mlp.{p}.weight": "dense layers" for p in _LLAMA_MLP})
    return names


def _dense_layers(cfg: dict) -> int:
    """DeepSeek-V3's layers with a dense MLP (first_k_dense_replace; absent or null: all of them)."""
    dense = cfg.get("first_k_dense_replace")
    return cfg["num_hidden_layers"] if dense is None else dense


def _family(cfg: dict) -> str | None:
    """"deepseek" (MLA), "llama" (the Llama family) or None (architectures whose own checks refuse them)."""
    if cfg.get("model_type") == registry.TARGET_MODEL_TYPE:
        return "deepseek"
    return "llama" if cfg.get("model_type") in registry.SOURCE_MODEL_TYPES else None


def expected_tensors(cfg: dict) -> dict[str, str] | None:
    """{tensor name: why it is required} for the architectures kvconvert reads; None for others
    (their own checks refuse them)."""
    family = _family(cfg)
    if family is None:
        return None
    layer = _layer_names_deepseek if family == "deepseek" else _layer_names_llama
    names = {"model.embed_tokens.weight": "always", "model.norm.weight": "always"}
    if cfg.get("tie_word_embeddings") is not True:
        names["lm_head.weight"] = "tie_word_embeddings is not true"
    for i in range(cfg["num_hidden_layers"]):
        names.update(layer(cfg, i))
    return names


# config.json fields the tensor shapes follow from: required positive integers, and optional ones
# (absent or null: transformers' default, num_key_value_heads = num_attention_heads, head_dim =
# hidden_size / num_attention_heads, q_lora_rank = a plain q_proj)
_SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_REQUIRED_FIELDS = {"llama": _SHAPE_FIELDS,
                    "deepseek": (*_SHAPE_FIELDS, "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")}
_OPTIONAL_FIELDS = {"llama": ("num_key_value_heads", "head_dim"), "deepseek": ("q_lora_rank",)}
_COUNT_FIELDS = {"llama": (), "deepseek": ("first_k_dense_replace",)}  # optional, may be 0 or null
_ARCH_NAMES = {"llama": "a Llama-family config", "deepseek": "a DeepSeek-V3 MLA config"}


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _field_problem(key: str, value, least: int = 1) -> str:
    """Why `value` is not an integer >= `least`, with the fix."""
    need = "a positive integer" if least == 1 else f"an integer >= {least}"
    if isinstance(value, str) and value.strip().isdigit():
        return f"{key} is the string {value!r}, not a number; write it without quotes: \"{key}\": {int(value)}"
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{key} is {json.dumps(value)}; it must be {need}"
    what = " (the number of key/value heads: k_proj's rows / head_dim)" if key == "num_key_value_heads" else ""
    return f"{key} is {value}; it must be {need}{what}"


def check_config(cfg: dict, where: str = "config.json") -> None:
    """The config.json fields the weights' shapes follow from are positive integers (a missing or
    mistyped one is named here, before any command indexes or divides by it); other architectures
    pass (their own checks refuse them)."""
    family = _family(cfg)
    if family is None:
        return
    for key in _REQUIRED_FIELDS[family]:
        if key not in cfg or cfg[key] is None:
            raise CheckpointError(
                f"{where}: {key} is missing; kvconvert reads the weights' shapes from it ({_ARCH_NAMES[family]} "
                f"needs {', '.join(_REQUIRED_FIELDS[family])}). Restore it from the model's original config.json")
        if not _positive_int(cfg[key]):
            raise CheckpointError(f"{where}: {_field_problem(key, cfg[key])}")
    for key in _OPTIONAL_FIELDS[family]:
        if cfg.get(key) is not None and not _positive_int(cfg[key]):
            default = "" if key == "num_key_value_heads" else " (or null for transformers' default)"
            raise CheckpointError(f"{where}: {_field_problem(key, cfg[key])}{default}")
    for key in _COUNT_FIELDS[family]:
        value = cfg.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise CheckpointError(f"{where}: {_field_problem(key, value, least=0)}")
    if family == "llama":
        heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        if heads % kv_heads:
            raise CheckpointError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                                  f"{kv_heads}; each KV head serves a whole group of query heads: fix config.json")
        if head_dim(cfg) is None:
            raise CheckpointError(f"{where}: hidden_size {cfg['hidden_size']} is not a multiple of num_attention_heads "
                                  f"{heads} and there is no head_dim; add head_dim (q_proj's rows / heads)")


def _shape(*dims: tuple[int, str]) -> tuple[tuple[int, ...], str]:
    """(shape, how config.json gives it) from (size, field formula) pairs."""
    return tuple(n for n, _ in dims), "[" + ", ".join(f for _, f in dims) + "]"


def _linear_shapes(prefix: str, out: tuple[int, str], inp: tuple[int, str]) -> dict:
    """nn.Linear weight [out, in] and its (optional) bias [out]."""
    return {f"{prefix}.weight": _shape(out, inp), f"{prefix}.bias": _shape(out)}


def _llama_layer_shapes(cfg: dict, i: int) -> dict:
    hidden, inter = (cfg["hidden_size"], "hidden_size"), (cfg["intermediate_size"], "intermediate_size")
    heads, d = cfg["num_attention_heads"], head_dim(cfg)
    kv_heads = cfg.get("num_key_value_heads") or heads  # absent: transformers' default
    q, kv = (heads * d, "num_attention_heads x head_dim"), (kv_heads * d, "num_key_value_heads x head_dim")
    attention = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q)}
    shapes = {}
    for short, (out, inp) in attention.items():
        shapes.update(_linear_shapes(registry.SOURCE_ATTENTION[short].format(i=i).removesuffix(".weight"), out, inp))
    return {**shapes, **_mlp_and_norm_shapes(i, hidden, inter)}


def _mlp_and_norm_shapes(i: int, hidden: tuple[int, str], inter: tuple[int, str] | None) -> dict:
    shapes = {f"model.layers.{i}.{n}.weight": _shape(hidden) for n in ("input_layernorm", "post_attention_layernorm")}
    if inter is not None:
        for short, (out, inp) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                                  "down_proj": (hidden, inter)}.items():
            shapes.update(_linear_shapes(f"model.layers.{i}.mlp.{short}", out, inp))
    return shapes


def _deepseek_layer_shapes(cfg: dict, i: int) -> dict:
    hidden, heads = (cfg["hidden_size"], "hidden_size"), cfg["num_attention_heads"]
    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    latent = (rank, "kv_lora_rank")
    qk = (heads * (nope + rope), "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)")
    attention = {"q_proj": (qk, hidden), "kv_a_proj_with_mqa": ((rank + rope, "kv_lora_rank + qk_rope_head_dim"), hidden),
                 "kv_b_proj": ((heads * (nope + v), "num_attention_heads x (qk_nope_head_dim + v_head_dim)"), latent),
                 "o_proj": (hidden, (heads * v, "num_attention_heads x v_head_dim"))}
    if cfg.get("q_lora_rank"):
        q_rank = (cfg["q_lora_rank"], "q_lora_rank")
        attention.update(q_a_proj=(q_rank, hidden), q_b_proj=(qk, q_rank))
    shapes = {}
    for short, (out, inp) in attention.items():
        shapes.update(_linear_shapes(registry.TARGET_ATTENTION[short].format(i=i).removesuffix(".weight"), out, inp))
    shapes[registry.TARGET_ATTENTION["kv_a_layernorm"].format(i=i)] = _shape(latent)
    if cfg.get("q_lora_rank"):
        shapes[registry.TARGET_ATTENTION["q_a_layernorm"].format(i=i)] = _shape((cfg["q_lora_rank"], "q_lora_rank"))
    dense = i < _dense_layers(cfg)  # MoE layers' experts: not read
    inter = (cfg["intermediate_size"], "intermediate_size") if dense else None
    return {**shapes, **_mlp_and_norm_shapes(i, hidden, inter)}


def expected_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """{tensor name: (shape, how config.json gives it)} for every tensor of the architecture (biases
    and lm_head included, whether or not the config declares them); None for other architectures.
    Run after check_config (the fields are positive integers)."""
    family = _family(cfg)
    if family is None:
        return None
    layer = _deepseek_layer_shapes if family == "deepseek" else _llama_layer_shapes
    hidden = (cfg["hidden_size"], "hidden_size")
    rows = _shape((cfg["vocab_size"], "vocab_size"), hidden)
    shapes = {"model.embed_tokens.weight": rows, "lm_head.weight": rows, "model.norm.weight": _shape(hidden)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update(layer(cfg, i))
    return shapes


def _stored_shapes(reader: CheckpointReader) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from the safetensors headers (no tensor data is read)."""
    shapes = {}
    for shard in sorted(set(reader.weight_map.values())):
        for name, entry in safetensors_header(reader.path / shard).items():
            if reader.weight_map.get(name) == shard:
                shapes[name] = tuple(entry["shape"])
    return shapes


def _kv_heads_problem(cfg: dict, name: str, stored: tuple[int, ...], shapes: dict | None = None) -> str | None:
    """For a k_proj / v_proj whose rows are whole heads of head_dim: the heads it holds against the
    heads config.json says (or transformers' default when it says nothing). When the same layer's other
    projection (`shapes`: every stored shape) holds another number of heads, config.json is not what to change:
    one of the two tensors is damaged."""
    if not name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")) or _family(cfg) != "llama":
        return None
    held = kv_heads_held(cfg, stored)
    if held is None:
        return None
    mine, other = ("k_proj", "v_proj") if ".k_proj." in name else ("v_proj", "k_proj")
    partner = kv_heads_held(cfg, (shapes or {}).get(name.replace(f".{mine}.", f".{other}."), ()))
    if partner is not None and partner != held:
        said = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        agree = " (as config.json says)" if partner == said else ""
        return (f"holds {held} KV heads of head_dim {head_dim(cfg)}, but the same layer's {other} holds "
                f"{partner}{agree}: the tensor is damaged or from another checkpoint; re-download the checkpoint")
    says = (f"says num_key_value_heads {cfg['num_key_value_heads']}" if cfg.get("num_key_value_heads")
            else f"has no num_key_value_heads, so {cfg['num_attention_heads']} (transformers' default: "
                 "num_attention_heads)")
    return (f"holds {held} KV heads of head_dim {head_dim(cfg)}, but config.json {says}; if the weights are right, "
            f"set \"num_key_value_heads\": {held} in config.json, else re-download the checkpoint")


def check_tensor_shapes(reader: CheckpointReader) -> None:
    """Every tensor of the architecture has the shape config.json implies (safetensors headers only),
    else a one-line error naming the first that does not, its file and both shapes."""
    expected = expected_shapes(reader.config) or {}
    stored = _stored_shapes(reader)
    wrong = [n for n, (shape, _) in expected.items() if n in stored and stored[n] != shape]
    if not wrong:
        return
    name = wrong[0]
    (shape, formula), found = expected[name], stored[name]
    more = f" ({len(wrong) - 1} more tensors disagree too)" if len(wrong) > 1 else ""
    head = f"{reader.path / reader.weight_map[name]}: tensor {name!r} has shape {list(found)}"
    kv = _kv_heads_problem(reader.config, name, found, stored)
    if kv is not None:
        raise CheckpointError(f"{head}: it {kv}{more}")
    turned = "; it is stored transposed" if tuple(reversed(found)) == shape else ""
    raise CheckpointError(
        f"{head}, but config.json implies {list(shape)} ({formula}){turned}{more}; the weights and config.json "
        "disagree: re-export or re-download the checkpoint, or correct config.json")


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
    (CheckpointReader), config fields and features, expected tensors and their shapes, tokenizer
    files, finite weights."""
    reader = src if isinstance(src, CheckpointReader) else CheckpointReader(src)
    check_config(reader.config, str(reader.path / "config.json"))
    registry.check_supported_features(reader.config, str(reader.path / "config.json"))
    check_tensors_present(reader)
    check_tensor_shapes(reader)
    if tokenizer and expected_tensors(reader.config) is not None:  # other architectures: their own refusal first
        check_tokenizer_files(reader.path)
    if finite:
        check_finite_weights(reader)
