"""CheckpointReader errors: each a one-line CheckpointError naming the file at fault."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvconvert.checkpoint import CheckpointReader, CheckpointWriter
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


SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def _truncate(name: str, size: int):
    """Cut a file to `size` bytes (negative: that many bytes off its end)."""
    return lambda d: os.truncate(d / name, size if size >= 0 else (d / name).stat().st_size + size)


def _garbage_header(d):
    data = (d / SHARDS[0]).read_bytes()
    n = int.from_bytes(data[:8], "little")
    (d / SHARDS[0]).write_bytes(data[:8] + b"[" + b" " * (n - 1) + data[8 + n:])  # header JSON is not an object


def _index_names_a_tensor_its_shard_lacks(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.w"] = SHARDS[0]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _weights_only(name: str | None):
    """The safetensors files and index replaced by an (empty) file `name`; None: no weights at all."""
    def damage(d):
        for path in [*d.glob("*.safetensors"), d / "model.safetensors.index.json"]:
            path.unlink()
        if name is not None:
            (d / name).touch()
    return damage


@pytest.mark.parametrize("damage, expected", [
    (lambda d: (d / "config.json").unlink(), ["{d}/config.json", "not found"]),
    (lambda d: (d / "config.json").write_text("{not json"), ["{d}/config.json"]),
    (lambda d: os.rename(d, d.with_name("gone")), ["not a folder"]),
    (_truncate(SHARDS[1], -100), ["{d}/" + SHARDS[1], "truncated"]),
    (_truncate(SHARDS[2], 20), ["{d}/" + SHARDS[2], "corrupt"]),
    (_truncate(SHARDS[2], 3), ["shorter than"]),
    (_garbage_header, ["{d}/" + SHARDS[0]]),
    (lambda d: (d / SHARDS[1]).unlink(), [SHARDS[1], "missing"]),
    (lambda d: (d / "model.safetensors.index.json").write_text("{}"), ["model.safetensors.index.json"]),
    (_index_names_a_tensor_its_shard_lacks, ["{d}/" + SHARDS[0], "'model.layers.9.w'"]),
    (_weights_only("pytorch_model.bin"), [".bin", "safetensors"]),
    (_weights_only("model.gguf"), ["import-gguf"]),
    (_weights_only(None), ["no model.safetensors"]),
])
def test_damaged_folder_is_one_line_naming_the_file(sharded, damage, expected):
    damage(sharded)
    message = _error(sharded)
    assert all(text.format(d=sharded) in message for text in expected), message


def test_single_file_truncated(tmp_path):
    out = tmp_path / "one"
    with CheckpointWriter(out) as w:
        w.add("a", torch.randn(100))
        w.write_config({})
    os.truncate(out / "model.safetensors", (out / "model.safetensors").stat().st_size - 4)
    assert str(out / "model.safetensors") in _error(out)
