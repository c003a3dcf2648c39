"""Streaming: a ~420 MB sharded checkpoint is written layer by layer and one layer is read back
in a fresh process whose peak RSS grows by far less than the checkpoint size."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from kvconvert.checkpoint import CheckpointReader

LAYERS = 20
TENSOR_SHAPE = (1280, 1024)  # fp32: 5 MiB each; 4 per layer -> 20 MiB/layer, 400 MiB in all
SHARD_BYTES = 64 * 2**20
LAYER_BYTES = 4 * 1280 * 1024 * 4

_WRITE = textwrap.dedent("""
    import json, resource, sys, torch
    from kvconvert.checkpoint import CheckpointWriter
    out, layers, shape, shard = sys.argv[1], int(sys.argv[2]), tuple(json.loads(sys.argv[3])), int(sys.argv[4])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    g = torch.Generator().manual_seed(0)
    noise = {n: torch.rand(shape, generator=g) for n in ("q", "k", "v", "o")}  # U[0, 1)
    with CheckpointWriter(out, max_shard_bytes=shard) as w:
        for i in range(layers):  # one layer in hand at a time; the writer flushes full shards
            for name in ("q", "k", "v", "o"):  # fresh tensors, layer i uniform on [i, i + 1)
                w.add(f"model.layers.{i}.{name}.weight", noise[name] + i)
        w.write_config({"model_type": "llama", "num_hidden_layers": layers})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"increase": peak - base, "bytes": w.total_bytes}))
""")

_READ = textwrap.dedent("""
    import json, resource, sys, torch
    from kvconvert.checkpoint import CheckpointReader
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # after importing torch
    reader = CheckpointReader(sys.argv[1])
    layer = reader.tensors("model.layers.13.")
    total = sum(float(t.double().sum()) for t in layer.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"increase": peak - base, "names": sorted(layer), "sum": total,
                      "layer_bytes": sum(t.numel() * t.element_size() for t in layer.values())}))
""")


def _run(script: str, *args) -> dict:
    result = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def big_dir(tmp_path):
    """Folder for the ~420 MB checkpoint, deleted right after the test (pytest keeps tmp dirs)."""
    yield tmp_path / "big"
    shutil.rmtree(tmp_path / "big", ignore_errors=True)


def test_one_layer_is_read_without_loading_the_checkpoint(big_dir):
    out = big_dir
    written = _run(_WRITE, out, LAYERS, json.dumps(TENSOR_SHAPE), SHARD_BYTES)
    checkpoint_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert written["bytes"] == LAYERS * 4 * 1280 * 1024 * 4 and checkpoint_bytes > 400_000_000
    assert len(list(out.glob("model-*.safetensors"))) == 7
    # The writer holds one shard being filled (plus memory the allocator kept from the previous
    # one), never the checkpoint.
    assert written["increase"] < 2 * SHARD_BYTES + 2 * LAYER_BYTES < checkpoint_bytes / 2, written

    read = _run(_READ, out)
    assert read["names"] == [f"model.layers.13.{n}.weight" for n in ("k", "o", "q", "v")]
    assert read["layer_bytes"] == LAYER_BYTES
    assert 13.49 < read["sum"] / (4 * 1280 * 1024) < 13.51  # layer 13's values, uniform on [13, 14)
    assert read["increase"] < checkpoint_bytes / 4, (read["increase"], checkpoint_bytes)


def test_copy_and_drop_returns_the_tensor_and_releases_its_pages(tmp_path):
    """The export's single pass: each tensor copied out, its mapped pages dropped from RSS."""
    big = torch.randn(2048, 1024).to(torch.bfloat16)  # 4 MiB: whole pages
    save_file({"a": big, "b": torch.arange(10, dtype=torch.int64)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    reader = CheckpointReader(tmp_path, verify=False)

    def rss_file_kb() -> int:
        line = next(l for l in open("/proc/self/status") if l.startswith("RssFile:"))
        return int(line.split()[1])

    mapped = reader.mapped("a")
    mapped.float().sum()  # touch every page of the mapping
    touched = rss_file_kb()
    copy = reader.copy_and_drop("a")
    assert torch.equal(copy, big) and torch.equal(reader.copy_and_drop("b"), torch.arange(10))
    del mapped
    assert rss_file_kb() <= touched - 3 * 1024  # at least 3 of the 4 MiB left the process


def test_the_finite_scan_holds_one_tensor_not_the_checkpoint(tmp_path):
    """check_finite_weights reads every weight; its peak RSS must not grow with the checkpoint
    (a 7B scan would otherwise hold 13.5 GB of file pages)."""
    weights = {f"t{i}": torch.randn(1024, 1024).to(torch.bfloat16) for i in range(64)}  # 128 MiB in bf16
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    # VmHWM, not ru_maxrss: a child inherits its parent's ru_maxrss at exec (pytest's would hide it)
    code = textwrap.dedent(f"""
        from kvconvert.checkpoint import CheckpointReader
        from kvconvert.checkpoint.checks import check_finite_weights
        def hwm():
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])
        before = hwm()
        check_finite_weights(CheckpointReader({str(tmp_path)!r}, verify=False))
        print((hwm() - before) // 1024)
    """)
    grown_mb = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert grown_mb < 32, f"the scan's peak grew by {grown_mb} MB for a 128 MB checkpoint"  # was 133 MB
