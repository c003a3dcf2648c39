"""Distillation holds both models: its memory need is estimated from the configs and a run that
cannot fit is refused before anything loads (issue 16)."""

import json

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.heal.distill import check_distill_memory, distill_memory
from kvconvert.recipe import DistillStage
from kvconvert.runtime.memory import AVAILABLE_ENV

from heal_cases import distill_recipe

STUDENT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
           "intermediate_size": 96, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
           "v_head_dim": 16, "q_lora_rank": None, "model_type": "deepseek_v3", "n_routed_experts": 1,
           "first_k_dense_replace": 2, "tie_word_embeddings": False}
TEACHER = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 100, "intermediate_size": 96, "model_type": "llama", "tie_word_embeddings": False}


def test_distill_memory_by_hand():
    attention = 64 * 4 * 24 + 64 * 24 + 16 * 4 * 32 + 4 * 16 * 64  # q, kv_a, kv_b, o
    student_params = 2 * (attention + 16 + 3 * 64 * 96 + 2 * 64) + 2 * 100 * 64 + 64
    teacher_params = 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64) + 2 * 100 * 64 + 64
    stage = DistillStage(seq_len=32, batch_size=2)
    parts = distill_memory(STUDENT, TEACHER, stage)
    assert parts["student"] == 4 * student_params + 12 * 2 * attention
    assert parts["teacher"] == 4 * teacher_params
    per_layer = 64 * (16 * 64 + 4 * 96 + 2 * 4 * 32)
    assert parts["activations"] == 4 * (2 * per_layer + 4 * 64 * 100)
    light = distill_memory(STUDENT, TEACHER, DistillStage(seq_len=32, batch_size=2, mixed_precision="bf16",
                                                          gradient_checkpointing=True))
    assert light["teacher"] == parts["teacher"] // 2
    assert light["activations"] == 4 * (2 * 64 * 64 + per_layer + 4 * 64 * 100)


def test_refused_up_front_with_the_multi_gpu_path(monkeypatch):
    monkeypatch.setenv(AVAILABLE_ENV, "1000B")
    with pytest.raises(KVConvertError, match=r"student and the teacher resident.*accelerate launch.*layer-wise"):
        check_distill_memory(STUDENT, TEACHER, DistillStage(), torch.device("cpu"))
    monkeypatch.setenv(AVAILABLE_ENV, "64G")
    check_distill_memory(STUDENT, TEACHER, DistillStage(), torch.device("cpu"))


def test_heal_refuses_before_loading_the_models(tiny_student, tiny_teacher, text_file, tmp_path, monkeypatch):
    """Through the real `heal`: the distillation stage stops at the check, no output is written."""
    from kvconvert.heal.api import heal

    need = distill_memory(json.loads((tiny_student / "config.json").read_text()),
                          json.loads((tiny_teacher / "config.json").read_text()), DistillStage(seq_len=128, batch_size=2))
    monkeypatch.setenv(AVAILABLE_ENV, f"{sum(need.values()) // 2}B")
    with pytest.raises(KVConvertError, match="heal_distill needs"):
        heal(tiny_student, tiny_teacher, distill_recipe(text_file), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
