"""`--target`: kvconvert writes only MLA shapes the target engine serves (kvconvert.targets)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvconvert.errors import KVConvertError
from kvconvert.mla.budget_search import candidate_splits
from kvconvert.pipeline import _default_shape
from kvconvert.targets import TARGETS, check_servable, rope_dims_for, servable_shapes

SMOLLM2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
LLAMA3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}


def test_rope_dims_fold_the_head_dim():
    assert rope_dims_for(64) == [2, 4, 8, 16, 32, 64]
    assert rope_dims_for(128) == [2, 4, 8, 16, 32, 64]  # capped at 64 (DeepSeek's rope head)
    assert rope_dims_for(96) == [2, 4, 6, 8, 12, 16, 24, 32, 48]


@pytest.mark.parametrize("kv_heads, head_dim, first", [(3, 64, (256, 64)), (8, 128, (512, 64)), (32, 128, (512, 64))])
def test_vllm_shapes_put_deepseeks_split_first(kv_heads, head_dim, first):
    shapes = servable_shapes(TARGETS["vllm"], kv_heads, head_dim)
    assert shapes[0] == first
    assert all(r + p in (576, 320) and p >= 8 and r <= 2 * kv_heads * head_dim - p for r, p in shapes)


def test_smollm2_cannot_hold_a_512_latent():
    # 2 x 3 x 64 = 384 values: a 576 latent would be larger than the source's K+V
    assert {r + p for r, p in servable_shapes(TARGETS["vllm"], 3, 64)} == {320}
    assert servable_shapes(TARGETS["tensorrt-llm"], 3, 64) == []
    assert servable_shapes(TARGETS["tensorrt-llm"], 8, 128) == [(512, 64)]


def test_refusal_names_the_servable_sizes_and_the_escape():
    with pytest.raises(KVConvertError) as err:
        check_servable("vllm", 160, 32, 3, 64)
    msg = str(err.value)
    assert "latent of 192 values" in msg and "576 or 320" in msg
    assert "--rank 256 --rope-dim 64 (320 values, 83% of the source K+V)" in msg and "--target any" in msg
    check_servable("any", 160, 32, 3, 64)
    check_servable("kvconvert", 160, 32, 3, 64)
    check_servable("vllm", 256, 64, 3, 64)
    with pytest.raises(KVConvertError, match="No servable shape fits this model"):
        check_servable("tensorrt-llm", 256, 64, 3, 64)


def test_kv_budget_picks_among_servable_shapes():
    assert candidate_splits(LLAMA3_8B, 1024, "vllm") == [(512, 64), (544, 32), (560, 16), (568, 8)]
    assert candidate_splits(LLAMA3_8B, 400, "vllm")[0] == (256, 64)
    assert candidate_splits(SMOLLM2, 330, "vllm")[0] == (256, 64)
    with pytest.raises(KVConvertError, match=r"320 \(83%\).*--target any"):
        candidate_splits(SMOLLM2, 192, "vllm")
    # research target: every valid split of exactly the budget
    assert candidate_splits(SMOLLM2, 192, "any") == [(184, 8), (176, 16), (160, 32), (128, 64)]


def test_mla_cli_refuses_an_unservable_shape_before_any_work(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kvconvert.cli", "mla", "--src", "smollm2-135m", "--rank", "160",
                           "--rope-dim", "32", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "576 or 320" in proc.stderr and "--target any" in proc.stderr
    assert not out.exists()


def test_pipeline_default_shape_is_the_largest_servable_latent():
    assert _default_shape("smollm2-135m", "vllm", None) == (256, 64)
    assert _default_shape("smollm2-135m", "vllm", 32) == (288, 32)
    with pytest.raises(KVConvertError, match="serves no MLA latent smaller"):
        _default_shape("smollm2-135m", "tensorrt-llm", None)
    with pytest.raises(KVConvertError, match="give --rank"):
        _default_shape("smollm2-135m", "any", None)


def test_llamacpp_takes_any_latent_in_whole_32_value_blocks():
    """llama.cpp's DEEPSEEK2 loads any latent; its quantized caches need kv_lora_rank and the rope part in
    blocks of 32 (kvconvert.targets' module docstring), which --target llamacpp keeps to."""
    llamacpp = TARGETS["llamacpp"]
    assert llamacpp.serves(256, 64) and llamacpp.serves(160, 32) and llamacpp.serves(64, 32)
    assert not llamacpp.serves(176, 16) and not llamacpp.serves(100, 28)
    check_servable("llamacpp", 160, 32, 3, 64)
    with pytest.raises(KVConvertError, match=r"--rank 176 --rope-dim 16: llamacpp does not serve it: .*multiples of 32"):
        check_servable("llamacpp", 176, 16, 3, 64)
    assert candidate_splits(SMOLLM2, 192, "llamacpp") == [(160, 32), (128, 64)]
    with pytest.raises(KVConvertError, match="no valid rank \\+ rope-dim split.*multiples of 32"):
        candidate_splits(SMOLLM2, 100, "llamacpp")


def test_llamacpps_shape_rule_is_one_function():
    """Blocks of 32 must tile each cached head: per-head K/V head_dim; MLA's K row rank + rope and its V view rank.
    --target llamacpp, calibrate, the runtime, plan and export-gguf all ask this one rule."""
    from kvconvert.targets import check_llamacpp_shape, llamacpp_config_problem, llamacpp_shape_problem

    assert llamacpp_shape_problem(64, 64) is None and llamacpp_shape_problem(48, 48, False, False) is None
    assert "48 values of a cached K head" in llamacpp_shape_problem(48, 48)
    assert "16 values of a cached V head" in llamacpp_shape_problem(64, 16)  # MLA 16 + 48: the row tiles, V does not
    assert llamacpp_shape_problem(48, 48, k_quantized=False, v_quantized=True).endswith("cached V head")
    for rank, rope in ((33, 16), (40, 32), (16, 2), (48, 16)):
        assert not TARGETS["llamacpp"].serves(rank, rope)
        with pytest.raises(KVConvertError, match="llama.cpp refuses the cache"):
            check_llamacpp_shape("q4_0", True, rank=rank, rope_dim=rope)
        check_llamacpp_shape("bf16", True, rank=rank, rope_dim=rope)  # a float cache serves any shape
    assert TARGETS["llamacpp"].serves(256, 64) and TARGETS["llamacpp"].serves(32, 32)
    for head_dim in (48, 16):
        with pytest.raises(KVConvertError, match=f"head_dim {head_dim}"):
            check_llamacpp_shape("q5_0/iq4_nl", False, head_dim=head_dim)
    check_llamacpp_shape("fp8", False, head_dim=48)
    assert llamacpp_config_problem({"num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3,
                                    "hidden_size": 576}) is None
