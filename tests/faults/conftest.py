"""Fixtures for the fault tests: one tiny checkpoint per fault, built offline from the tiny Llama of
tests/quant (word-level tokenizer, 2 layers, hidden 64), plus tmpfs mounts for full and read-only
disks (the tests run as root, for whom chmod does not stop a write; a mount does)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / folder) for folder in ("quant", "eval")]
from quant_cases import make_llama  # noqa: E402

from kvconvert.checkpoint.writer import TOKENIZER_FILES  # noqa: E402
from kvconvert.st_header import INDEX_NAME  # noqa: E402


def _variant(base: Path, folder: Path, tensors=None, config=None) -> Path:
    """A copy of `base` with its tensors / config.json changed by the given functions."""
    shutil.copytree(base, folder)
    if tensors is not None:
        weights = load_file(folder / "model.safetensors")
        tensors(weights)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def _rewritten(base: Path, folder: Path, **writer_args) -> Path:
    """`base` written again by CheckpointWriter (manifest.json; sharded with a small max_shard_bytes)."""
    from kvconvert.checkpoint import CheckpointReader, CheckpointWriter

    src = CheckpointReader(base)
    with CheckpointWriter(folder, **writer_args) as w:
        for name in src.keys():
            w.add(name, src.get(name))
        w.write_config(src.config)
        w.copy_tokenizer(base)
    return folder


def _drop_from_shard(folder: Path, name: str) -> None:
    """Remove tensor `name` from the shard that holds it, the index left unchanged."""
    shard = folder / json.loads((folder / INDEX_NAME).read_text())["weight_map"][name]
    weights = load_file(shard)
    del weights[name]
    save_file(weights, shard, metadata={"format": "pt"})
    (folder / "manifest.json").unlink()  # a partial download has no manifest either


@pytest.fixture(scope="session")
def faults(tmp_path_factory) -> dict[str, Path]:
    """name -> model folder (see the comments below for the newer ones). base: healthy; nan: NaN in layer 1's k_proj; missing: layer 1's
    k_proj removed; bias: config declares attention_bias without bias tensors; sliding: a Llama
    config with sliding_window 256 (< max_position_embeddings 512) and use_sliding_window true;
    tied: tied embeddings (no lm_head) and a 16384-row embedding, so lm_head's own copy matters."""
    root = tmp_path_factory.mktemp("faults")
    base = make_llama(root / "base")

    def nan(w):
        w["model.layers.1.self_attn.k_proj.weight"][0, 0] = float("nan")

    def tie(w):
        del w["lm_head.weight"]
        w["model.embed_tokens.weight"] = torch.randn(16384, w["model.embed_tokens.weight"].shape[1]) * 0.02

    partial = _rewritten(base, root / "partial", max_shard_bytes=64 * 1024)
    _drop_from_shard(partial, "model.layers.1.self_attn.k_proj.weight")
    notok = _variant(base, root / "notok")
    for name in TOKENIZER_FILES:
        (notok / name).unlink(missing_ok=True)
    return {
        "base": base,
        # sharded, the index listing a tensor its shard lacks (a partial download)
        "partial": partial,
        # no tokenizer files at all
        "notok": notok,
        # the same config with other weights (seed 1)
        "other": make_llama(root / "other", seed=1),
        # base written by CheckpointWriter: a manifest.json with every file's sha256
        "written": _rewritten(base, root / "written"),
        "nan": _variant(base, root / "nan", tensors=nan),
        "missing": _variant(base, root / "missing", tensors=lambda w: w.pop("model.layers.1.self_attn.k_proj.weight")),
        "bias": _variant(base, root / "bias", config=lambda c: c.update(attention_bias=True)),
        "sliding": _variant(base, root / "sliding",
                            config=lambda c: c.update(sliding_window=256, use_sliding_window=True)),
        "tied": _variant(base, root / "tied", tensors=tie,
                         config=lambda c: c.update(tie_word_embeddings=True, vocab_size=16384)),
    }


@pytest.fixture
def mounts():
    """mounts(path, options) mounts a tmpfs (e.g. "size=3m" or "ro,size=1m"); unmounted at teardown."""
    made = []

    def mount(path: Path, options: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); needs root in a container that allows it")
        made.append(path)
        return path

    yield mount
    for path in reversed(made):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="session")
def input_faults(faults, tmp_path_factory) -> dict[str, Path]:
    """name -> model folder for tests/faults/test_input_faults.py: the healthy tiny Llama (2 KV heads of 4
    query heads, head_dim 16, hidden 64) with one config.json field or one tensor broken, as seen on small
    copies of real checkpoints, and a tiny DeepSeek-V3 MLA with the same kind of faults."""
    from quant_cases import make_deepseek

    root, base = tmp_path_factory.mktemp("input_faults"), faults["base"]
    k_proj, v_proj = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    latin1 = _variant(base, root / "latin1")  # a Latin-1 editor's save: "café" as one 0xe9 byte
    text = (latin1 / "config.json").read_bytes()
    (latin1 / "config.json").write_bytes(text.replace(b'"model_type"', b'"_name": "caf\xe9",\n  "model_type"'))
    as_list = _variant(base, root / "list")
    (as_list / "config.json").write_bytes(b"[" + (base / "config.json").read_bytes() + b"]")
    mla = make_deepseek(root / "mla")
    return {
        "latin1": latin1,
        "list": as_list,
        "no_hidden": _variant(base, root / "no_hidden", config=lambda c: c.pop("hidden_size")),
        # transformers' rule: no num_key_value_heads = num_attention_heads (4), but k_proj holds 2 heads
        "no_kv": _variant(base, root / "no_kv", config=lambda c: c.pop("num_key_value_heads")),
        "kv0": _variant(base, root / "kv0", config=lambda c: c.update(num_key_value_heads=0)),
        "layers_str": _variant(base, root / "layers_str", config=lambda c: c.update(num_hidden_layers="2")),
        # MHA weights (4 KV heads) without num_key_value_heads: the default is right, nothing to refuse
        "no_kv_mha": _variant(make_llama(root / "mha", kv_heads=4), root / "no_kv_mha",
                              config=lambda c: c.pop("num_key_value_heads")),
        "transposed": _variant(base, root / "transposed", tensors=lambda w: w.update({k_proj: w[k_proj].t().contiguous()})),
        "wrong_size": _variant(base, root / "wrong_size", tensors=lambda w: w.update({v_proj: torch.zeros(32, 32)})),
        "norm": _variant(base, root / "norm", tensors=lambda w: w.update(
            {"model.layers.0.input_layernorm.weight": torch.ones(8, 8)})),
        "mla": mla,
        "mla_kv_b": _variant(mla, root / "mla_kv_b", tensors=lambda w: w.update({kv_b: w[kv_b].t().contiguous()})),
        "mla_no_rank": _variant(mla, root / "mla_no_rank", config=lambda c: c.pop("kv_lora_rank")),
    }


@pytest.fixture(scope="session")
def silent_faults(faults, tmp_path_factory) -> dict[str, Path]:
    """name -> folder for tests/faults/test_silent_faults.py. no_kv: config.json without num_key_value_heads
    over tensors of 2 KV heads; retuned: base with layer 1's q_proj scaled by 1.5 (same shapes, embeddings and
    MLPs: the heal's shared-tensor check passes, the weights are another model's); student: base converted to
    MLA 16+8 by kvconvert (its manifest records base and base's fingerprint)."""
    from kvconvert.mla.convert import MLAOptions, convert_to_mla

    root, base = tmp_path_factory.mktemp("silent_faults"), faults["base"]
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    student = root / "student"
    convert_to_mla(base, student, MLAOptions(rank=16, rope_dim=8, target="any", calib_tokens=512, calib_window=128,
                                             dtype="fp32"), source_name=str(base), progress=False)
    return {
        "no_kv": _variant(base, root / "no_kv", config=lambda c: c.pop("num_key_value_heads")),
        "retuned": _variant(base, root / "retuned", tensors=lambda w: w[q_proj].mul_(1.5)),
        "student": student,
    }
