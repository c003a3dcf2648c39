"""scripts/bench_memory.py: per-child peak RSS and the shared random-checkpoint writer (bench_mla.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from runtime_cases import SCRIPTS, load_script


def test_peak_rss_is_each_childs_own(tmp_path):
    """A big child then a small one: the small one's peak is its own, not the running maximum that
    RUSAGE_CHILDREN would report. Run from a small middle process, as the bench runs from a shell:
    a child inherits its parent's RSS high-water mark at exec, and this pytest process holds torch."""
    import json
    import subprocess

    code = f"""
import json, sys
from pathlib import Path
sys.path.insert(0, {str(SCRIPTS)!r})
import bench_memory as b
assert "torch" not in sys.modules
big = b.run_child([sys.executable, "-c", "x = bytearray(400 * 2**20); x[::4096] = bytes(len(x[::4096]))"], Path({str(tmp_path)!r}) / "big.log")
small = b.run_child([sys.executable, "-c", "pass"], Path({str(tmp_path)!r}) / "small.log")
failed = b.run_child([sys.executable, "-c", "raise SystemExit(3)"], Path({str(tmp_path)!r}) / "f.log")
print(json.dumps([big, small, failed]))
"""
    big, small, failed = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                   check=True).stdout)
    assert big["rc"] == small["rc"] == 0
    assert big["peak_rss_gb"] > 0.4 and small["peak_rss_gb"] < 0.05, (big, small)
    assert failed["rc"] == 3 and "error_tail" in failed


def test_random_checkpoint_has_the_real_shapes_and_runs_mapped(tmp_path):
    from kvconvert.checkpoint import CheckpointReader
    from kvconvert.kvmath import parameter_count
    from kvconvert.runtime import LLM, SamplingParams
    from kvconvert.sources import resolve_source

    try:
        tokenizer = resolve_source("smollm2-135m")
    except Exception as exc:  # noqa: BLE001 - the default model is not imported on this machine
        pytest.skip(f"SmolLM2 tokenizer not available: {exc}")
    mla = load_script("bench_mla")
    folder = tmp_path / "tiny"
    mla.write_random_llama(folder, tokenizer, "tinyllama-1.1b", layers=1)
    with CheckpointReader(folder) as reader:
        cfg = reader.config
        assert {k: cfg[k] for k in mla.LLAMA_SHAPES["tinyllama-1.1b"] if k != "num_hidden_layers"} == \
            {k: v for k, v in mla.LLAMA_SHAPES["tinyllama-1.1b"].items() if k != "num_hidden_layers"}
        assert reader.num_parameters() == parameter_count(cfg)
        assert reader.shape("model.layers.0.self_attn.k_proj.weight") == (4 * 64, 2048)
        assert {reader.stored_dtype(k) for k in reader.keys()} == {torch.bfloat16}
    llm = LLM(folder, num_blocks=4, max_model_len=64)
    assert llm.dtype == torch.bfloat16
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, greedy=True, ignore_eos=True))[0]
    assert len(out.token_ids) == 2
