"""CheckpointReader errors: each a one-line CheckpointError naming the file at fault."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvconvert.checkpoint import CheckpointReader, CheckpointWriter, check_safetensors_file, read_config
from kvconvert.errors import CheckpointError


@pytest.fixture
def sharded(tmp_path):
    """A 3-shard checkpoint of 6 float32 [64, 32] tensors."""
    out = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(1)
    with CheckpointWriter(out, max_shard_bytes=16_000) as w:
        for i in range(6):
            w.add(f"model.layers.{i}.w", torch.randn(64, 32, generator=g))
        w.write_config({"model_type": "llama"})
    return out


def _error(folder, **kwargs) -> str:
    with pytest.raises(CheckpointError) as exc:
        reader = CheckpointReader(folder, **kwargs)
        for name in reader.keys():
            reader.get(name)
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_reads_back_and_reports_shapes(sharded):
    reader = CheckpointReader(sharded)
    assert reader.config == {"model_type": "llama"}
    assert reader.shape("model.layers.4.w") == (64, 32)
    assert "model.layers.4.w" in reader and "nope" not in reader
    assert reader.total_bytes == sum(p.stat().st_size for p in sharded.glob("*.safetensors"))
    with pytest.raises(CheckpointError, match="'nope' not in checkpoint"):
        reader.get("nope")


def test_missing_config(sharded):
    (sharded / "config.json").unlink()
    message = _error(sharded)
    assert str(sharded / "config.json") in message and "not found" in message


def test_broken_config(sharded):
    (sharded / "config.json").write_text("{not json")
    assert "config.json" in _error(sharded)
    with pytest.raises(CheckpointError):
        read_config(sharded)


def test_not_a_folder(tmp_path):
    assert "not a folder" in _error(tmp_path / "missing")


def test_truncated_shard(sharded):
    shard = sharded / "model-00002-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    message = _error(sharded)
    assert str(shard) in message and "truncated" in message


def test_truncated_inside_the_header(sharded):
    shard = sharded / "model-00003-of-00003.safetensors"
    os.truncate(shard, 20)
    message = _error(sharded)
    assert str(shard) in message and "corrupt" in message
    os.truncate(shard, 3)
    assert "shorter than" in _error(sharded)


def test_garbage_header(sharded):
    shard = sharded / "model-00001-of-00003.safetensors"
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    shard.write_bytes(data[:8] + b"[" + b" " * (n - 1) + data[8 + n:])  # header JSON is not an object
    assert str(shard) in _error(sharded)


def test_single_file_truncated(tmp_path):
    out = tmp_path / "one"
    with CheckpointWriter(out) as w:
        w.add("a", torch.randn(100))
        w.write_config({})
    os.truncate(out / "model.safetensors", (out / "model.safetensors").stat().st_size - 4)
    assert str(out / "model.safetensors") in _error(out)
    with pytest.raises(CheckpointError):
        check_safetensors_file(out / "model.safetensors")


def test_shard_named_in_index_but_absent(sharded):
    (sharded / "model-00002-of-00003.safetensors").unlink()
    message = _error(sharded)
    assert "model-00002-of-00003.safetensors" in message and "missing" in message


def test_tensor_named_in_index_but_absent_from_its_shard(sharded):
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.w"] = "model-00001-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    reader = CheckpointReader(sharded)
    with pytest.raises(CheckpointError) as exc:
        reader.get("model.layers.9.w")
    assert "model-00001-of-00003.safetensors" in str(exc.value) and "\n" not in str(exc.value)


def test_unreadable_index(sharded):
    (sharded / "model.safetensors.index.json").write_text("{}")
    assert "model.safetensors.index.json" in _error(sharded)


def test_bin_only_folder_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    message = _error(tmp_path)
    assert ".bin" in message and "safetensors" in message


def test_gguf_only_folder_points_to_import(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert "import-gguf" in _error(tmp_path)


def test_empty_folder_with_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert "no model.safetensors" in _error(tmp_path)
