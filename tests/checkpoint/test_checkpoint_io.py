"""CheckpointWriter: atomic commit, overwrite rules, sharding + index, manifest hashes; CheckpointReader's
errors: each a one-line CheckpointError naming the file at fault."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvconvert.checkpoint import CheckpointReader, CheckpointWriter, verify_manifest
from kvconvert.errors import CheckpointError, OutputExistsError


def _tensors(n: int = 6, shape=(64, 32)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(*shape, generator=g) for i in range(n)}


def _write(out, tensors, **kwargs):
    with CheckpointWriter(out, **kwargs) as w:
        for name, t in tensors.items():
            w.add(name, t)
        w.write_config({"model_type": "test"})
    return out


@pytest.fixture
def sharded(tmp_path):
    """A 3-shard checkpoint of _tensors(6): float32 [64, 32], 8 KiB each."""
    return _write(tmp_path / "ckpt", _tensors(6), max_shard_bytes=16_000, source="unit-test")


def _raise_after_two_shards(w):
    w.add("a", torch.ones(8))  # max_shard_bytes=1: a shard flushed on every add
    w.add("b", torch.ones(8))
    w.write_config({})
    raise RuntimeError("boom")


@pytest.mark.parametrize("body, error, match", [
    (_raise_after_two_shards, RuntimeError, "boom"),
    (lambda w: w.add("a", torch.ones(8)), CheckpointError, "config.json"),  # the commit fails
    (lambda w: [w.add("a", torch.ones(2)) for _ in range(2)], ValueError, "twice"),
    # _all_finite is checked per dtype against isfinite in tests/faults
    (lambda w: w.add("bad", torch.tensor([1.0, float("inf")], dtype=torch.bfloat16)), CheckpointError, "NaN or inf"),
], ids=["exception-in-body", "missing-config", "duplicate-name", "non-finite"])
def test_failure_inside_with_leaves_nothing(tmp_path, body, error, match):
    with pytest.raises(error, match=match):
        with CheckpointWriter(tmp_path / "out", max_shard_bytes=1) as w:
            body(w)
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temp folder


def test_interrupt_lost_inside_c_code_does_not_commit(tmp_path):
    """A SIGTERM whose exception C code swallowed leaves the body running to its end: the writer
    still must not rename a checkpoint the user asked to stop."""
    import signal

    from kvconvert import errors
    out, before = tmp_path / "out", signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt):
            with CheckpointWriter(out) as w:
                w.add("a", torch.ones(2))
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                except KeyboardInterrupt:
                    pass  # what the C code did
        assert not out.exists() and not list(tmp_path.iterdir())
    finally:
        errors._interrupted.clear()
    assert signal.getsignal(signal.SIGTERM) is before  # restored by the writer (in-process CLI tests may have set it)


def test_existing_output_refused_and_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        CheckpointWriter(out)
    assert (out / "keep.txt").read_text() == "mine"


def test_overwrite_replaces_the_whole_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.safetensors").write_text("old")
    tensors = _tensors(2)
    _write(out, tensors, overwrite=True)  # one shard: named model.safetensors, no index
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no backup or temp left behind
    reader = CheckpointReader(out)
    assert all(torch.equal(reader.get(k), v) for k, v in tensors.items())


def test_failed_overwrite_keeps_the_old_output(tmp_path):
    out = _write(tmp_path / "out", _tensors(1))
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ValueError):
        with CheckpointWriter(out, overwrite=True) as w:
            w.add("x", torch.ones(2))
            raise ValueError("interrupted")
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_sharding_index_and_manifest(sharded):
    tensors, out = _tensors(6), sharded
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == 6 * 64 * 32 * 4
    reader = CheckpointReader(out)
    assert sorted(reader.keys()) == sorted(tensors) and reader.config == {"model_type": "test"}
    for name, t in tensors.items():
        got = reader.get(name)
        assert got.dtype == torch.float32 and torch.equal(got, t)
    assert reader.tensors("model.layers.3.").keys() == {"model.layers.3.w"}
    assert reader.num_parameters() == 6 * 64 * 32 and reader.shape("model.layers.4.w") == (64, 32)
    assert "model.layers.4.w" in reader and "nope" not in reader
    assert reader.total_bytes == sum(p.stat().st_size for p in out.glob("*.safetensors"))
    with pytest.raises(CheckpointError, match="'nope' not in checkpoint"):
        reader.get("nope")

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == "unit-test" and manifest["producer"].startswith("kvconvert")
    assert set(manifest["files"]) == {*shards, "config.json", "model.safetensors.index.json"}
    assert verify_manifest(out) == []
    shard = out / shards[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # flip one byte of tensor data
    shard.write_bytes(bytes(data))
    assert verify_manifest(out) == [shards[1]]


def test_written_files_are_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        out = _write(tmp_path / "out", _tensors(2), max_shard_bytes=1)
    finally:
        os.umask(old)
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o644)}


def test_same_tensor_under_two_names(tmp_path):
    """Tied embeddings written as an explicit lm_head: safetensors refuses shared memory."""
    embed = torch.randn(10, 4)
    reader = CheckpointReader(_write(tmp_path / "out", {"model.embed_tokens.weight": embed, "lm_head.weight": embed,
                                                        "first_rows": embed[:3]}))
    assert torch.equal(reader.get("lm_head.weight"), embed)
    assert torch.equal(reader.get("first_rows"), embed[:3])


def test_dtypes_and_huge_finite_values_round_trip(tmp_path):
    tensors = {"bf16": torch.randn(4, 16).to(torch.bfloat16), "fp8": torch.randn(4, 16).to(torch.float8_e4m3fn),
               "u8": torch.randint(0, 255, (4, 8), dtype=torch.uint8), "scale": torch.tensor(0.5)}
    # the finiteness check must not overflow on tensors full of the largest finite values
    tensors.update({f"max_{d}": torch.full((100_000,), torch.finfo(d).max, dtype=d)
                    for d in (torch.float32, torch.float16, torch.float64)})
    out = _write(tmp_path / "out", tensors)
    reader = CheckpointReader(out)
    for name, t in tensors.items():
        got = reader.get(name)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn \
            else torch.equal(got, t)
    assert reader.get("bf16", dtype=torch.float32).dtype == torch.float32


def test_tokenizer_files_and_json_are_copied(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text("{}")
    (src / "unrelated.txt").write_text("no")
    with CheckpointWriter(tmp_path / "out") as w:
        w.add("a", torch.ones(2))
        w.write_config({})
        assert sorted(w.copy_tokenizer(src)) == ["tokenizer.json", "tokenizer_config.json"]
        w.write_json("hf_quant_config.json", {"producer": {"name": "kvconvert"}})
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "hf_quant_config.json"} <= names
    assert "unrelated.txt" not in names


def test_transformers_loads_a_sharded_output(tmp_path):
    """The index/shard layout is the one transformers reads: same logits after a round trip."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    out = tmp_path / "out"
    with CheckpointWriter(out, max_shard_bytes=50_000) as w:
        for name, t in model.state_dict().items():
            w.add(name, t)
        w.write_config(config.to_dict())
    assert len(list(out.glob("model-*.safetensors"))) > 2
    loaded = LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


# ------------------------------------------------------------------ reading damaged checkpoints

def _error(folder, **kwargs) -> str:
    with pytest.raises(CheckpointError) as exc:
        reader = CheckpointReader(folder, **kwargs)
        for name in reader.keys():
            reader.get(name)
    message = str(exc.value)
    assert "\n" not in message, message
    return message


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
