"""What a distillation run holds in memory, from the configs and the stage's options (pure: no torch
device is asked anything; the device's capacity is an argument), and the refusal check built on it.

It counts what kvconvert.heal.distill.Distiller really keeps, per micro-batch of N = batch x seq_len
tokens (a = bytes of an activation: 2 under bf16/fp16 autocast, else 4; the student is loaded in
fp32, the teacher in bf16 under mixed_precision bf16, else fp32):

  student, teacher      4 x student params, but 2 for the frozen matmul weights under autocast
                        (stored in the compute dtype once: heal.distill.store_frozen_matmuls_in; on a
                        CPU from a float32 file, 4 + 2: the file's pages stay mapped); 2 or 4 x teacher
                        params
  gradients, optimizer  4 + 8 bytes per TRAINED parameter: the attention weights `targets` names
                        (full), or their LoRA factors (lora: rank x (in + out) each, + their fp32 copy);
                        fused Adam adds nothing, torch's foreach Adam (CUDA default) one more 4 bytes
  weight copies         what autograd saves of the weights: each trained weight is recomputed from its
                        parametrization (heal.reparam) and saved (a bytes); under FSDP + autocast every
                        frozen matmul weight the backward passes through is saved as its bf16 cast
                        (lm_head's always; the layers' all at once, or one layer's under checkpointing)
  activations           per token and layer (below), x layers; with gradient checkpointing each layer's
                        fp32 input plus one layer's worth (recomputed in the backward)
  attention probs       kept only where the attention keeps them: eager attention, and torch's SDPA on
                        a CPU when the student's query/key and value head sizes differ (SDPA's math
                        path); SDPA's flash / memory-efficient kernels on a GPU keep none
  logits                teacher [N, V] + student [N, V] (in the autocast dtype: the Distiller undoes
                        accelerate's float32 output conversion) + the fused loss's stored gradient [N, V]
                        (heal.fused_loss: computed in chunks, stored once in the logits' dtype) + its
                        float32 chunk temporaries (4, + the fp32 copy of each bf16 logits chunk) +
                        lm_head's saved input

Per token and layer, what autograd saves (frozen linears save no input; trained ones save theirs):
the two RMSNorm inputs (the fp32 residual stream, 8 x hidden), the input of every trained projection
(the normed hidden state, once in fp32 or once per projection as its autocast copy; the normed latent
for kv_b_proj; the attention output for o_proj), the latent RMSNorm's fp32 input, attention's q, k, v
(+ output and log-sum-exp on the fused kernels), RoPE's fp32 query under autocast, and the MLP's
gate, SiLU and up outputs (3 x intermediate).

Measured against this (scripts/bench_distill.py rows, tests/heal/test_distill_memory_measured.py):
peak RSS on a CPU (minus the process's RSS before the run: the interpreter and libraries are not
the run's), torch.cuda.max_memory_allocated on a GPU.
"""

from __future__ import annotations

from kvconvert.heal.fused_loss import chunk_rows
from kvconvert.heal.options import DistillOptions
from kvconvert.memory import DISTILL_OVERHEAD, MemoryEstimate, gb

# transformers' default attention for both models as kvconvert.quant.capture.load_hf_model loads them
# (no attn_implementation given: "sdpa" where the architecture supports it, which Llama and
# DeepseekV3 do); the Distiller checks the loaded models against it.
LOADER_ATTENTION = "sdpa"
# float32 [chunk, V] temporaries alive at once inside the fused loss (log_p, p, log_q, grad)
LOSS_CHUNK_TEMPORARIES = 4


def per_head_dims(student: dict) -> dict:
    """A student that keeps per-head K/V (the teacher's own architecture, healed for its cache) in the MLA terms
    the estimates use: no latent, q/k and v heads of head_dim (an MLA config is returned as it is)."""
    if "kv_lora_rank" in student:
        return student
    head_dim = student.get("head_dim") or student["hidden_size"] // student["num_attention_heads"]
    return {**student, "kv_lora_rank": 0, "qk_nope_head_dim": head_dim, "qk_rope_head_dim": 0,
            "v_head_dim": head_dim, "num_key_value_heads": student.get("num_key_value_heads") or
            student["num_attention_heads"]}


def attention_shapes(student: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of each trainable attention weight one student layer has."""
    student = per_head_dims(student)
    if student["kv_lora_rank"] == 0:  # per-head K/V
        hidden, heads, d = student["hidden_size"], student["num_attention_heads"], student["v_head_dim"]
        kv = student["num_key_value_heads"] * d
        return {"q_proj": (heads * d, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
                "o_proj": (hidden, heads * d)}
    hidden, heads = student["hidden_size"], student["num_attention_heads"]
    rank, rope = student["kv_lora_rank"], student["qk_rope_head_dim"]
    nope, v = student["qk_nope_head_dim"], student["v_head_dim"]
    q_lora = student.get("q_lora_rank")
    q = ({"q_proj": (heads * (nope + rope), hidden)} if not q_lora else
         {"q_a_proj": (q_lora, hidden), "q_b_proj": (heads * (nope + rope), q_lora)})
    return {**q, "kv_a_proj_with_mqa": (rank + rope, hidden), "kv_b_proj": (heads * (nope + v), rank),
            "o_proj": (hidden, heads * v)}


def trained_weights(student: dict, stage: DistillOptions) -> dict[str, tuple[int, int]]:
    """The weights of one layer `stage.targets` makes trainable (those the layer has)."""
    shapes = attention_shapes(student)
    return {name: shapes[name] for name in stage.targets if name in shapes}


def trainable_parameters(student: dict, stage: DistillOptions) -> int:
    """Parameters the optimizer updates: the targeted weights themselves, or their LoRA factors."""
    per_layer = sum(o * i if stage.train == "full" else stage.lora_rank * (o + i)
                    for o, i in trained_weights(student, stage).values())
    return student["num_hidden_layers"] * per_layer


def keeps_attention_probs(student: dict, attention: str, device_type: str) -> bool:
    """Whether the student's attention saves its [heads, T, T] probabilities for the backward."""
    student = per_head_dims(student)
    if attention == "eager":
        return True
    qk = student["qk_nope_head_dim"] + student["qk_rope_head_dim"]
    return attention == "sdpa" and device_type == "cpu" and qk != student["v_head_dim"]


def activation_bytes_per_token(student: dict, stage: DistillOptions, device_type: str,
                               attention: str = LOADER_ATTENTION) -> int:
    """Bytes autograd saves per token in one student layer (without the T x T probabilities)."""
    student = per_head_dims(student)
    a = 2 if stage.mixed_precision != "no" else 4
    hidden, inter, heads = student["hidden_size"], student["intermediate_size"], student["num_attention_heads"]
    rank, v = student["kv_lora_rank"], student["v_head_dim"]
    qk = student["qk_nope_head_dim"] + student["qk_rope_head_dim"]
    q_lora = student.get("q_lora_rank") or 0
    trained = trained_weights(student, stage)
    reads_x = [n for n in ("q_proj", "q_a_proj", "kv_a_proj_with_mqa", "k_proj", "v_proj") if n in trained]
    inputs = (len(reads_x) * 2 * hidden if a == 2 else 4 * hidden) if reads_x else 0
    inputs += a * (rank * ("kv_b_proj" in trained) + heads * v * ("o_proj" in trained)
                   + q_lora * ("q_b_proj" in trained))
    norms = 4 * (2 * hidden + rank + q_lora)  # residual stream x2, latent (and q_lora) RMSNorm inputs, fp32
    attn = a * heads * (2 * qk + v)  # q, k, v
    if not keeps_attention_probs(student, attention, device_type) and attention != "eager":
        attn += a * heads * v + 4 * heads  # fused kernels: output and log-sum-exp
    rope_upcast = 4 * heads * qk if a == 2 else 0  # fp32 cos/sin promote the query under autocast
    return norms + inputs + attn + rope_upcast + 3 * a * inter


def distill_memory(student: dict, teacher: dict, stage: DistillOptions, device_type: str = "cuda",
                   attention: str = LOADER_ATTENTION, fused_optimizer: bool | None = None,
                   shards: int = 1) -> MemoryEstimate:
    """Bytes distillation holds at its peak, by part: the fused loss's forward with every activation saved,
    or under gradient checkpointing the larger of that and the backward's recomputed layer; `weights` is
    the student's, `overhead` kvconvert.memory.DISTILL_OVERHEAD of the device type (the CUDA context and
    the allocator's fragmentation; in RAM the interpreter, torch, transformers and accelerate, and the
    allocator's slack), which `allocated` leaves out.

    Pure: configs (config.json dicts) and options in, numbers out. device_type: "cuda" or "cpu" (which
    attention kernel runs, which Adam is torch's default); attention: the models' attn_implementation.
    shards: processes an FSDP launch shards both models over (heal.fsdp, one unit per decoder layer):
    weights, gradients and Adam states are 1/shards per process, plus one unit gathered whole at a time;
    the activations and logits of a process's own micro-batch stay as they are."""
    from kvconvert.kvformat import stored_bytes
    from kvconvert.kvmath import parameter_count

    a = 2 if stage.mixed_precision != "no" else 4
    layers, hidden, vocab = student["num_hidden_layers"], student["hidden_size"], student["vocab_size"]
    heads, n_tokens, seq = student["num_attention_heads"], stage.batch_size * stage.seq_len, stage.seq_len
    trainable = trainable_parameters(student, stage)
    fused = stage.fused_optimizer if fused_optimizer is None else fused_optimizer
    foreach_tmp = 4 * trainable if not fused and device_type == "cuda" else 0

    trained_elems = sum(o * i for o, i in trained_weights(student, stage).values())  # one layer
    layer_matmuls = sum(o * i for o, i in attention_shapes(student).values()) + 3 * hidden * student["intermediate_size"]
    tied = bool(student.get("tie_word_embeddings"))
    # Under autocast without FSDP the Distiller stores the frozen matmul weights in the compute dtype
    # (heal.distill.store_frozen_matmuls_in): 2 bytes instead of 4, and no per-step cast. With FSDP
    # they stay float32 and autocast keeps a cast copy of each frozen weight the backward passes.
    frozen_cast = a == 2 and shards == 1
    frozen_matmuls = layers * (layer_matmuls - trained_elems) + (0 if tied else vocab * hidden)
    # a layer's weight copies: the trained weights recomputed (a bytes), and the autocast casts of the
    # frozen ones the backward goes through where they are still float32
    layer_copies = a * trained_elems + (2 * (layer_matmuls - trained_elems) if a == 2 and not frozen_cast else 0)
    lm_head_copy = 2 * vocab * hidden if a == 2 and (tied or not frozen_cast) else 0

    per_token = activation_bytes_per_token(student, stage, device_type, attention)
    probs = (4 + a if attention == "eager" else 2 + a) * heads * seq * n_tokens  # per layer, when kept
    one_layer = per_token * n_tokens + (probs if keeps_attention_probs(student, attention, device_type) else 0)

    teacher_bytes = 2 if stage.mixed_precision == "bf16" else 4
    chunk = min(n_tokens, chunk_rows(vocab)) * vocab * 4  # one float32 [chunk, V] temporary
    # + the float32 copy of each chunk of logits that are not float32 already (the loss upcasts per chunk)
    temporaries = LOSS_CHUNK_TEMPORARIES + (a != 4) + (teacher_bytes != 4)
    logits = n_tokens * vocab * (teacher_bytes + 2 * a) + temporaries * chunk + a * n_tokens * hidden
    if stage.gradient_checkpointing:
        # the forward keeps each layer's fp32 input; one layer is recomputed in the backward, after
        # both logits and the loss's temporaries are freed (the stored [N, V] gradient stays)
        freed = n_tokens * vocab * (teacher_bytes + a) + temporaries * chunk
        copies = lm_head_copy
        activations = layers * 4 * hidden * n_tokens + max(0, one_layer + layer_copies - freed)
    else:
        copies = layers * layer_copies + lm_head_copy
        activations = layers * one_layer
    hidden_states = (layers + 1) * n_tokens * hidden * teacher_bytes if stage.hidden_weight > 0 else 0
    lora_weights = 4 * trainable if stage.train == "lora" else 0
    # on a CPU the checkpoint's pages of the weights the parametrization replaced stay mapped (and read);
    # so do the frozen matmuls' float32 pages when the file holds float32 (loaded without a copy, their
    # bf16 casts are new memory), while from a bf16 file the float32 load is a copy the cast frees
    replaced = 4 * layers * trained_elems if device_type == "cpu" else 0
    mapped_fp32 = device_type == "cpu" and stored_bytes(student.get("torch_dtype") or student.get("dtype")) == 4
    frozen_bytes = (2 * frozen_matmuls if mapped_fp32 else -2 * frozen_matmuls) if frozen_cast else 0
    parts = {
        "weights": 4 * parameter_count(student) + frozen_bytes + lora_weights + replaced,
        "teacher_weights": teacher_bytes * parameter_count(teacher),
        "gradients": 4 * trainable,
        "optimizer": 8 * trainable + foreach_tmp,
    }
    if shards > 1:
        parts = {part: -(-b // shards) for part, b in parts.items()}
        # one decoder layer of each model gathered whole (the units are layers; a layer's share of
        # the parameter count bounds it, embeddings included)
        parts["gathered"] = (4 * parameter_count(student) + teacher_bytes * parameter_count(teacher)) // layers
    return MemoryEstimate(**parts, weight_copies=copies, activations=activations + hidden_states, logits=logits,
                          overhead=DISTILL_OVERHEAD[device_type])


def distill_memory_problem(student: dict, teacher: dict, stage: DistillOptions, capacity: int, device_type: str,
                           where: str = "", attention: str = LOADER_ATTENTION, shards: int = 1) -> str | None:
    """Why the run cannot fit in `capacity` bytes of `device_type` memory (distill_memory's total, its
    overhead included), or None when it fits. Pure: the refusal check with the device's capacity as an argument."""
    need = distill_memory(student, teacher, stage, device_type, attention, shards=shards)
    if need.total <= capacity:
        return None
    return (f"heal_distill needs the student and the teacher resident at once: about {need.describe()} at "
            f"seq_len {stage.seq_len} x batch {stage.batch_size}, but only {gb(capacity)} is "
            f"{where or device_type}. Lower batch_size (keep "
            f"the tokens per step with grad_accum), switch gradient_checkpointing on, use mixed_precision bf16, "
            f"train fewer targets or train: lora; or run it on a GPU with more memory (recipes/*-gpu.yaml), or shard "
            f"it over several GPUs with `accelerate launch` + FSDP (docs/heal.md, 'One GPU, several GPUs'); or heal "
            f"with the streaming layer-wise stage only (heal_distill: enabled: false)")


# Distillation speeds measured with this loop (device, where the device's name must contain `name`,
# teacher parameters, tokens/s, where it was measured). A plan gives a time only for these.
MEASURED_SPEEDS = (
    ("cuda", "H100", 134_515_008, 57_000.0, "SmolLM2-135M 50% (160 + 32), b8s2048 bf16, H100: 56-58K tokens/s, "
                                            "docs/bench_heal_gpu.json"),
    ("cuda", "H200", 134_515_008, 61_000.0, "SmolLM2-135M 50% (160 + 32), b8s2048 bf16, H200: 61-65K tokens/s "
                                             "(100K with heal_distill.compile), docs/bench_distill_h200.json"),
    ("cuda", "H200", 6_738_415_616, 7_165.0, "Llama-2-7B-shaped MLA 512 + 64, b1s2048 bf16, every attention weight, "
                                              "no checkpointing, H200: 7.2-7.8K tokens/s, docs/bench_distill_7b_h200.json"),
    ("cpu", "", 134_515_008, 58.0, "SmolLM2-135M 50% (160 + 32), b1s512 fp32, one thread of a 2-core machine: "
                                   "58 tokens/s, docs/bench_heal_50pct.json"),
)


def measured_speed(teacher: dict, device_type: str, device_name: str = "") -> tuple[float, str] | None:
    """(tokens/s, its source) measured for a teacher of this size (within 10%) on this kind of device."""
    from kvconvert.kvmath import parameter_count

    params = parameter_count(teacher)
    for kind, name, size, speed, source in MEASURED_SPEEDS:
        if kind == device_type and name in device_name and abs(params - size) <= 0.1 * size:
            return speed, source
    return None


def plan_lines(student: dict, teacher: dict, stage: DistillOptions, device_type: str, device_name: str = "") -> list[str]:
    """What `kvconvert heal` prints before distilling: the memory estimate by part, the trained
    parameters, the tokens, and a time estimate where a measured tokens/s exists for the device."""
    need = distill_memory(student, teacher, stage, device_type)
    what = ", ".join(trained_weights(student, stage)) or "nothing"
    lines = [f"heal_distill plan on {device_name or device_type}: memory ~{need.describe()}",
             f"  trains {trainable_parameters(student, stage) / 1e6:.1f}M parameters ({stage.train}: {what}, "
             f"{student['num_hidden_layers']} layers); {stage.tokens} tokens = {stage.steps} steps of "
             f"{stage.tokens_per_step}"]
    speed = measured_speed(teacher, device_type, device_name)
    if speed:
        lines.append(f"  time ~{_duration(stage.tokens / speed[0])} at {speed[0]:.0f} tokens/s (measured: {speed[1]})")
    else:
        lines.append("  time: not estimated (no tokens/s measured for a model of this size on this device)")
    return lines


def _duration(seconds: float) -> str:
    """Minutes up to two hours, then hours (a billions-of-tokens heal runs for days on one GPU)."""
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.0f} h"


# --------------------------------------------------------------------------- configs without weights

def mla_student_config(source: dict, rank: int, rope_dim: int, q_rank: int | None = None) -> dict:
    """The config.json `kvconvert mla` writes for `source` at rank + rope_dim (no weights needed)."""
    from kvconvert import kvmath
    from kvconvert.mla.convert_layer import LayerPlan
    from kvconvert.mla.deepseek_format import deepseek_config

    plan = LayerPlan.for_source(kvmath.head_dim(source), rank, rope_dim)
    return deepseek_config(source, rank, rope_dim, plan.nope_dim, plan.v_dim, q_rank, "float32")


def recipe_configs(recipe) -> tuple[dict, dict]:
    """(student, teacher) configs of a recipe whose `source` is a kvconvert.presets model (by preset
    name or hub id) and which has a convert block: what its heal distils, sized without downloading."""
    from kvconvert.presets import PRESETS

    source = recipe.source or ""
    entry = PRESETS.get(source.lower()) or next(
        (p for p in PRESETS.values() if p["source"].split(":")[0].lower() == source.lower()), None)
    convert = recipe.stage("convert")
    if entry is None or convert is None:
        raise ValueError(f"recipe {recipe.name}: source {source!r} is not a preset, or no convert block")
    teacher = dict(entry["config"])
    return mla_student_config(teacher, convert.rank, convert.rope_dim, convert.q_rank), teacher
