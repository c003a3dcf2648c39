"""Distillation holds both models: its memory need is estimated from the configs (kvconvert.heal.memory,
a pure function of the configs, the options and the device's capacity) and a run that cannot fit is
refused before anything loads."""

import json

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.heal.distill import check_distill_memory
from kvconvert.heal.memory import (
    LOADER_ATTENTION, distill_memory, distill_memory_problem, recipe_configs, trainable_parameters,
)
from kvconvert.memory import AVAILABLE_ENV, DISTILL_OVERHEAD
from kvconvert.recipe import DistillStage, load_recipe

from heal_cases import distill_recipe

STUDENT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
           "intermediate_size": 96, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
           "v_head_dim": 16, "q_lora_rank": None, "model_type": "deepseek_v3", "n_routed_experts": 1,
           "first_k_dense_replace": 2, "tie_word_embeddings": False}
TEACHER = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 100, "intermediate_size": 96, "model_type": "llama", "tie_word_embeddings": False}
ATTENTION = {"q_proj": 64 * 4 * 24, "kv_a_proj_with_mqa": 64 * 24, "kv_b_proj": 16 * 4 * 32, "o_proj": 4 * 16 * 64}


def test_distill_memory_by_hand():
    """fp32 on a GPU, every attention weight trained, 2 x 32 tokens: each part counted by hand."""
    attention = sum(ATTENTION.values())
    student_params = 2 * (attention + 16 + 3 * 64 * 96 + 2 * 64) + 2 * 100 * 64 + 64
    teacher_params = 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64) + 2 * 100 * 64 + 64
    stage = DistillStage(seq_len=32, batch_size=2)
    parts = distill_memory(STUDENT, TEACHER, stage, "cuda")
    assert parts.weights == 4 * student_params and parts.teacher_weights == 4 * teacher_params
    assert parts.gradients == 4 * 2 * attention and parts.optimizer == 8 * 2 * attention  # fused Adam
    assert parts.weight_copies == 4 * 2 * attention  # each trained weight recomputed and saved
    # per token and layer: norm inputs 4(2*64 + 16), q/kv_a input 4*64, kv_b and o_proj inputs 4(16 + 64),
    # q, k, v 4*4(24 + 24 + 16), SDPA output and lse 4*4*16 + 4*4, MLP 3*4*96
    per_token = 4 * (2 * 64 + 16) + 4 * 64 + 4 * (16 + 64) + 4 * 4 * 64 + (4 * 4 * 16 + 4 * 4) + 3 * 4 * 96
    assert parts.activations == 2 * 64 * per_token
    assert parts.logits == 64 * 100 * (4 + 4 + 4) + 4 * 64 * 100 * 4 + 4 * 64 * 64


def test_what_each_switch_changes():
    base = DistillStage(seq_len=32, batch_size=2)
    parts = distill_memory(STUDENT, TEACHER, base, "cuda")
    ckpt = distill_memory(STUDENT, TEACHER, base.model_copy(update={"gradient_checkpointing": True}), "cuda")
    # layer inputs, + one layer recomputed in the backward (its activations and weight copies) beyond
    # what the logits and the loss's temporaries freed before it
    freed = 64 * 100 * (4 + 4) + 4 * 64 * 100 * 4
    recomputed = parts.activations // 2 + parts.weight_copies // 2
    assert ckpt.activations == 2 * 64 * 4 * 64 + max(0, recomputed - freed) and ckpt.weight_copies == 0
    bf16 = distill_memory(STUDENT, TEACHER, base.model_copy(update={"mixed_precision": "bf16"}), "cuda")
    assert bf16.teacher_weights == parts.teacher_weights // 2 and bf16.activations < parts.activations
    lora = base.model_copy(update={"train": "lora", "lora_rank": 2})
    lora_params = 2 * 2 * sum(o + i for o, i in ((96, 64), (24, 64), (128, 16), (64, 64)))
    assert trainable_parameters(STUDENT, lora) == lora_params
    assert distill_memory(STUDENT, TEACHER, lora, "cuda").optimizer == 8 * lora_params
    only_o = base.model_copy(update={"targets": ("o_proj",)})
    assert trainable_parameters(STUDENT, only_o) == 2 * ATTENTION["o_proj"]
    foreach = distill_memory(STUDENT, TEACHER, base.model_copy(update={"fused_optimizer": False}), "cuda")
    assert foreach.optimizer == parts.optimizer + 4 * 2 * sum(ATTENTION.values())
    # eager attention, and SDPA's math path on a CPU (q/k head 24 != v head 16), keep the probabilities
    probs = 2 * 4 * 32 * 32 * 2  # layers x (batch x heads x T x T) x ...
    eager = distill_memory(STUDENT, TEACHER, base, "cuda", attention="eager")
    assert eager.activations - parts.activations == probs * (4 + 4) - 2 * 64 * (4 * 4 * 16 + 4 * 4)
    cpu = distill_memory(STUDENT, TEACHER, base, "cpu")
    assert cpu.activations - parts.activations == probs * (2 + 4) - 2 * 64 * (4 * 4 * 16 + 4 * 4)


def test_refusal_is_a_function_of_the_capacity():
    stage = DistillStage(seq_len=32, batch_size=2)
    need = distill_memory(STUDENT, TEACHER, stage, "cuda").total
    assert need == distill_memory(STUDENT, TEACHER, stage, "cuda").allocated + DISTILL_OVERHEAD["cuda"]
    assert distill_memory_problem(STUDENT, TEACHER, stage, need, "cuda") is None
    problem = distill_memory_problem(STUDENT, TEACHER, stage, need - 1, "cuda", "free on cuda:0")
    assert "free on cuda:0" in problem and "gradient_checkpointing" in problem and "accelerate launch" in problem


@pytest.mark.parametrize("name", ["smollm2-135m-12pct-gpu", "smollm2-135m-25pct-gpu", "smollm2-135m-33pct-gpu",
                                  "smollm2-135m-50pct-gpu", "smollm2-135m-mla320-fp8-gpu", "llama-2-7b-mla512",
                                  "llama-3.1-8b-mla512"])
def test_shipped_gpu_recipes_fit_an_80gb_gpu(name):
    """The shipped GPU recipes pass the check on an 80 GB GPU (an estimate that counted eager attention
    probabilities and fp32 vocabulary copies claimed 118 GB for SmolLM2 b8s2048 and refused them all)."""
    from pathlib import Path

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / f"{name}.yaml")
    student, teacher = recipe_configs(recipe)
    assert distill_memory_problem(student, teacher, recipe.distill, 80 * 10**9, "cuda") is None


def test_every_gpu_recipe_is_listed():
    from pathlib import Path

    names = {p.stem for p in (Path(__file__).resolve().parents[2] / "recipes").glob("*-gpu.yaml")}
    assert names <= {"smollm2-135m-12pct-gpu", "smollm2-135m-25pct-gpu", "smollm2-135m-33pct-gpu",
                     "smollm2-135m-50pct-gpu", "smollm2-135m-mla320-fp8-gpu"}, "add the new GPU recipe to test_shipped_gpu_recipes_fit_an_80gb_gpu"


def test_refused_up_front_with_the_multi_gpu_path(monkeypatch):
    monkeypatch.setenv(AVAILABLE_ENV, "1000B")
    with pytest.raises(KVConvertError, match=r"student and the teacher resident.*accelerate launch.*layer-wise"):
        check_distill_memory(STUDENT, TEACHER, DistillStage(), torch.device("cpu"))
    monkeypatch.setenv(AVAILABLE_ENV, "64G")
    check_distill_memory(STUDENT, TEACHER, DistillStage(), torch.device("cpu"))


def test_loader_attention_is_what_the_estimate_assumes(tiny_student, tiny_teacher):
    from kvconvert.quant.capture import load_hf_model

    for folder in (tiny_student, tiny_teacher):
        assert load_hf_model(folder).config._attn_implementation == LOADER_ATTENTION


def test_heal_refuses_before_loading_the_models(tiny_student, tiny_teacher, text_file, tmp_path, monkeypatch):
    """Through the real `heal`: the distillation stage stops at the check, no output is written."""
    from kvconvert.recipe import heal

    need = distill_memory(json.loads((tiny_student / "config.json").read_text()),
                          json.loads((tiny_teacher / "config.json").read_text()), DistillStage(seq_len=128, batch_size=2),
                          "cpu")
    monkeypatch.setenv(AVAILABLE_ENV, f"{need.allocated // 2}B")
    with pytest.raises(KVConvertError, match="heal_distill needs"):
        heal(tiny_student, tiny_teacher, distill_recipe(text_file), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_the_7b_recipe_fits_80gb_and_frozen_matmuls_count_in_bf16():
    from pathlib import Path

    from kvconvert.kvmath import parameter_count

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "llama-2-7b-mla512.yaml")
    student, teacher = recipe_configs(recipe)
    for ckpt in (True, False):
        stage = recipe.distill.model_copy(update={"gradient_checkpointing": ckpt})
        assert distill_memory_problem(student, teacher, stage, 80 * 10**9, "cuda") is None
    stage = recipe.distill
    assert stage.mixed_precision == "bf16"
    one = distill_memory(student, teacher, stage, "cuda")
    # the frozen MLP weights and the untied lm_head (4.46B values) are held in bf16, nothing is cast per step
    frozen = 32 * 3 * 4096 * 11008 + 32000 * 4096
    assert one.weights == 4 * parameter_count(student) - 2 * frozen
    # what autograd keeps of the weights: only the trained ones, recomputed from their parametrization in bf16
    assert not stage.gradient_checkpointing and one.weight_copies == 2 * trainable_parameters(student, stage)
    # under FSDP they stay float32 (sharded), and autocast's bf16 copies come back
    two = distill_memory(student, teacher, stage, "cuda", shards=2)
    assert two.weights == -(-4 * parameter_count(student) // 2) and two.weight_copies > 0
    assert trainable_parameters(student, recipe.distill) == 32 * (4096 * 32 * 192 + 4096 * 576 + 512 * 32 * 256
                                                                  + 32 * 128 * 4096)


def test_plan_gives_a_time_only_where_a_speed_was_measured():
    from kvconvert.heal.memory import plan_lines, recipe_configs as configs
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    small = load_recipe(recipes / "smollm2-135m-50pct-gpu.yaml")
    lines = plan_lines(*configs(small), small.distill, "cuda", "NVIDIA H100 80GB HBM3")
    assert "memory ~" in lines[0] and "33.7M parameters" in lines[1] and "4718592 tokens = 288 steps" in lines[1]
    assert "time ~1 min at 57000 tokens/s (measured: " in lines[2] and "bench_heal_gpu.json" in lines[2]
    big = load_recipe(recipes / "llama-2-7b-mla512.yaml")
    assert "not estimated" in plan_lines(*configs(big), big.distill, "cuda", "NVIDIA H100 80GB HBM3")[2]
    # the recipe's 6B tokens: 6e9 / 7165 tokens/s = 233 h on one H200
    assert "time ~233 h at 7165 tokens/s (measured: " in plan_lines(*configs(big), big.distill, "cuda", "NVIDIA H200")[2]


def test_fsdp_shards_the_models_states_not_the_activations():
    """Under FSDP on N GPUs each process holds 1/N of both models, the gradients and Adam's states plus
    one gathered decoder layer; its own micro-batch's activations and logits are unchanged. The 7B
    recipe without gradient checkpointing at 4 x 2048 tokens does not fit one 80 GB GPU; sharded over 8
    it does. FSDP keeps the student's frozen weights float32 (one process stores them in bf16)."""
    from pathlib import Path

    from kvconvert.kvmath import parameter_count

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "llama-2-7b-mla512.yaml")
    student, teacher = recipe_configs(recipe)
    stage = recipe.distill.model_copy(update={"gradient_checkpointing": False, "batch_size": 4})
    one, eight = distill_memory(student, teacher, stage, "cuda"), distill_memory(student, teacher, stage, "cuda", shards=8)
    assert eight.weights == -(-4 * parameter_count(student) // 8)
    for part in ("teacher_weights", "gradients", "optimizer"):
        assert getattr(eight, part) == -(-getattr(one, part) // 8)
    for part in ("activations", "logits"):
        assert getattr(eight, part) == getattr(one, part)
    assert eight.weight_copies > one.weight_copies  # autocast's casts of the float32 frozen weights
    layer = 4 * parameter_count(student) // 32
    assert layer < eight.gathered < 3 * layer  # about a layer of each model (fp32 student, bf16 teacher)
    assert distill_memory_problem(student, teacher, stage, 80 * 10**9, "cuda") is not None
    assert distill_memory_problem(student, teacher, stage, 80 * 10**9, "cuda", shards=8) is None
