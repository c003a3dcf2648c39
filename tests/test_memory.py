"""One memory model: runtime, calibrate and distillation estimate into the one type of
kvconvert.memory, and no other module defines a second one."""

import ast
from pathlib import Path

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.heal.memory import distill_memory
from kvconvert.heal.options import DistillOptions
from kvconvert.memory import (
    AVAILABLE_ENV, CALIBRATE_SAFETY, DISTILL_OVERHEAD, MemoryEstimate, check_memory, dtype_name, resolve_dtype,
)
from kvconvert.quant.memory import calibration_memory
from kvconvert.runtime.memory import estimate_memory

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
MLA = {**LLAMA, "model_type": "deepseek_v3", "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
       "v_head_dim": 16, "q_lora_rank": None, "n_routed_experts": 1, "first_k_dense_replace": 2}


def test_the_three_stages_return_the_one_type():
    runtime = estimate_memory(LLAMA, torch.float32, kv_cache_bytes=1000)
    calibrate = calibration_memory(LLAMA, 1024, 512, 2, 512)
    distill = distill_memory(MLA, LLAMA, DistillOptions(seq_len=32, batch_size=2), "cpu")
    for est in (runtime, calibrate, distill):
        assert type(est) is MemoryEstimate
        assert est.allocated + est.overhead == est.fixed + est.per_token * est.tokens
    assert runtime.total == runtime.fixed and distill.total == distill.allocated + DISTILL_OVERHEAD["cpu"]
    assert calibrate.total == int(CALIBRATE_SAFETY * (calibrate.fixed + 64 * 4 * 1024))


def test_tokens_that_fit_is_the_inverse_of_total():
    est = calibration_memory(LLAMA, 1024, 512, 2, 512)
    fit = est.tokens_that_fit(est.total + 10**6)
    assert MemoryEstimate(**{**vars(est), "tokens": fit}).total <= est.total + 10**6
    assert MemoryEstimate(**{**vars(est), "tokens": fit + 1}).total > est.total + 10**6
    assert MemoryEstimate(weights=5).tokens_that_fit(10) == 0  # nothing grows with the tokens


def test_describe_names_every_nonzero_part_and_the_check_the_option_that_fits(monkeypatch):
    need = MemoryEstimate(weights=4 * 10**9, kv_cache=10**9, overhead=5 * 10**8)
    assert need.describe() == "5.50 GB (weights 4.00 GB, KV cache 1.00 GB, overhead 0.50 GB)"
    monkeypatch.setenv(AVAILABLE_ENV, "3G")
    with pytest.raises(KVConvertError, match=r"needs about 5\.50 GB .* only 3\.22 GB is available; use --dtype bf16"):
        check_memory(need, "x", [("--more", need), ("--dtype bf16", MemoryEstimate(weights=2 * 10**9))])


def test_dtype_names_round_trip():
    for name in ("bf16", "fp16", "fp32"):
        assert dtype_name(resolve_dtype(name, torch.float32)) == name


def test_no_second_memory_estimate_type():
    defined = [path.relative_to(ROOT).as_posix() for folder in ("kvconvert", "runtime", "kernels")
               for path in (ROOT / folder).rglob("*.py")
               if any(isinstance(node, ast.ClassDef) and node.name.endswith("MemoryEstimate")
                      for node in ast.walk(ast.parse(path.read_text())))]
    assert defined == ["kvconvert/memory.py"]
