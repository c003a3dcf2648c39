"""The options of the two healing stages: one pydantic model each, which is the recipe's
`heal_layerwise` / `heal_distill` block, the argument of kvconvert.heal (run_layerwise, Distiller)
and (generated, as --layerwise-* / --distill-*) flags of `kvconvert heal`. Torch-free."""

from __future__ import annotations

from typing import Literal, Protocol, get_args

from pydantic import Field, model_validator

from kvconvert.device import DEVICE_FIELD
from kvconvert.kvformat import CALIBRATE_KV_DTYPES, kv_dtype_type
from kvconvert.stage_options import StageOptions, TextMix, text_source_help

# Attention projections that can train; those a checkpoint lacks are skipped (q_proj, or the
# low-rank query pair q_a_proj / q_b_proj when the conversion used q_lora_rank; k_proj / v_proj where the
# student keeps the teacher's per-head K/V, the MLA projections where it is a conversion).
AttentionName = Literal["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "k_proj", "v_proj",
                        "o_proj"]
TRAINABLE_ATTENTION = get_args(AttentionName)
DATA_HELP = text_source_help("teacher (text sampled from the teacher)")
MAX_LAYERWISE_STEPS = 10_000


class LayerwiseOptions(StageOptions):
    """Layer-wise reconstruction of each converted attention block (kvconvert.heal.layerwise).
    Weights are optimised in units of their own RMS, so one relative lr fits every tensor."""

    data: TextMix = Field("builtin", description=DATA_HELP)
    tokens: int = Field(32768, gt=0, description="Calibration tokens (windows of --layerwise-window).")
    window: int = Field(512, gt=0, description="Tokens per calibration window.")
    # 10000 per layer is ~50x the recipes' largest (200, ~15 min for a 7B on an H100): hours to days on a GPU
    steps: int = Field(100, ge=0, le=MAX_LAYERWISE_STEPS, description="Adam steps per layer (heal_distill, not "
                                                                      "more steps, trains the whole model).")
    batch_windows: int = Field(1, gt=0, description="Calibration windows per step.")
    lr: float = Field(5e-3, gt=0, description="Relative step (in units of each weight's RMS).")
    # per layer i, x = normed block input:
    #   student_input     min |A_s(x_s) - A_t(x_s)|
    #   teacher_input     min |A_s(x_t) - A_t(x_t)|
    #   student_residual  min |h_s + A_s(x_s) - (h_t + A_t(x_t))|  (also repairs earlier layers' drift)
    target: Literal["student_input", "teacher_input", "student_residual"] = Field(
        "student_input", description="What each student block is fitted to: the teacher block at the student's "
                                     "input, both at the teacher's input, or the teacher's residual stream.")
    refit_o_proj: bool = Field(True, description="Finish each layer with a least-squares o_proj (exact optimum "
                                                 "given the rest).")
    train: tuple[AttentionName, ...] = Field(TRAINABLE_ATTENTION, description="Attention projections to train.")
    seed: int = Field(0, description="Random seed (the windows each step takes).")
    device: str = DEVICE_FIELD

    @model_validator(mode="after")
    def _enough_windows(self):
        if self.tokens < self.window:
            raise ValueError(f"tokens ({self.tokens}) is less than one window ({self.window})")
        return self


class DistillOptions(StageOptions):
    """End-to-end distillation: KL(teacher || student) on next-token distributions, + lm_weight x CE,
    + hidden_weight x the mean over layers of |h_s - h_t|^2 / |h_t|^2 (the residual streams).
    steps = tokens / (batch_size x seq_len x grad_accum)."""

    data: TextMix = Field("builtin", description=DATA_HELP)
    tokens: int = Field(65536, gt=0, description="Training tokens in total.")
    seq_len: int = Field(512, gt=0, description="Tokens per training sequence.")
    batch_size: int = Field(1, gt=0, description="Sequences per micro-batch.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    lr: float = Field(5e-4, gt=0, description="Relative step (in units of each weight's RMS).")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps.")
    schedule: Literal["cosine", "constant", "linear"] = Field("cosine", description="lr schedule after warm-up.")
    kl_weight: float = Field(1.0, ge=0, description="Weight of KL(teacher || student).")
    lm_weight: float = Field(0.0, ge=0, description="Weight of the next-token cross-entropy.")
    hidden_weight: float = Field(0.0, ge=0, description="Weight of the relative residual-stream error.")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature of the KL.")
    kv_dtype: kv_dtype_type(CALIBRATE_KV_DTYPES) | None = Field(
        None, description="Cache-aware: the student reads its KV cache rounded as the engine stores it in this format "
                          "(straight-through gradient); llama.cpp's types as llama.cpp stores the healed checkpoint "
                          "(K/V pairs KTYPE/VTYPE too), the scaled ones (fp8, int8, nvfp4) as calibrate with the "
                          "same format will store it.")
    train: Literal["full", "lora"] = Field("full", description="Train the attention weights themselves, or "
                                                               "low-rank deltas merged at the end.")
    lora_rank: int = Field(16, gt=0, description="Rank of the LoRA deltas (--distill-train lora).")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA scale alpha (delta = alpha / rank x B A).")
    targets: tuple[AttentionName, ...] = Field(TRAINABLE_ATTENTION, description="Attention projections to train.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    mixed_precision: Literal["no", "bf16", "fp16"] = Field("no", description="accelerate's setting; on a CPU keep no.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass (long "
                                                            "seq_len on a GPU).")
    max_epochs: int = Field(1, gt=0, description="Times the data may be reused when it holds fewer than tokens.")
    checkpoint_every: int = Field(50, ge=0, description="Optimizer steps between resumable snapshots (0 = only at "
                                                        "the end).")
    log_every: int = Field(1, gt=0, description="Optimizer steps between history records.")
    seed: int = Field(0, description="Random seed (data order, LoRA init).")
    fused_optimizer: bool = Field(True, description="Adam's fused kernel (one pass over the weights, no temporary "
                                                    "the size of the trainable set); off: torch's default Adam.")
    compile: bool = Field(False, description="torch.compile each decoder layer (one compiled region reused by every "
                                             "layer: fewer kernel launches; a GPU's speed, tens of seconds of warm-up).")
    device: str = DEVICE_FIELD

    @model_validator(mode="after")
    def _weights(self):
        if self.kl_weight == 0 and self.lm_weight == 0 and self.hidden_weight == 0:
            raise ValueError("kl_weight, lm_weight and hidden_weight are all 0: nothing to train on")
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum

    @property
    def steps(self) -> int:
        return self.steps_on(1)

    def steps_on(self, processes: int) -> int:
        """Optimizer steps for `tokens` in total when `processes` data-parallel processes each take
        tokens_per_step per step (same data, same lr schedule length in tokens, however launched)."""
        return max(1, self.tokens // (self.tokens_per_step * processes))


HEAL_BLOCKS = ("heal_layerwise", "heal_distill")  # the two stages' blocks in a recipe


def without_device(recipe: dict) -> dict:
    """A dumped recipe with its heal blocks' device left out: it moves the work, not what a heal makes (what a
    heal's saved state and a heal stage's provenance compare)."""
    return {k: ({kk: vv for kk, vv in v.items() if kk != "device"} if k in HEAL_BLOCKS else v)
            for k, v in recipe.items()}


class HealStages(Protocol):
    """What a heal runs (kvconvert.heal.api.heal_stages): each stage's options, None where the stage is
    absent or disabled, and to_dict(), the recipe it came from as recorded in the healed checkpoint's
    manifest (kvconvert_heal.recipe) and, without the devices, in the resume fingerprint.
    A validated kvconvert.recipe.Recipe is one."""

    @property
    def layerwise(self) -> LayerwiseOptions | None: ...

    @property
    def distill(self) -> DistillOptions | None: ...

    def to_dict(self) -> dict: ...


class HealPlanOptions(StageOptions):
    """`kvconvert heal --plan` (kvconvert.heal.token_plan): short distillations of the recipe's heal_distill
    block at a few budgets, a power-law fit of held-out KL against tokens, and the tokens and hours to a
    KL target."""

    budgets: tuple[int, ...] = Field((8192, 16384, 32768), description="Distillation tokens of the short runs "
                                                                     "(three or more).")
    kl_target: float = Field(0.05, gt=0, description="KL(source || healed) to reach, nats/token on the held-out "
                                                     "windows.")
    devices: int = Field(1, gt=0, description="Devices the real run will use (data-parallel; the hours assume "
                                              "ideal scaling).")
    eval_data: str = Field("essays", description="Held-out text the KL is measured on (as --calib-data reads it).")
    eval_windows: int = Field(8, gt=1, description="Held-out windows (their spread gives each point's error).")
    eval_window: int = Field(512, gt=1, description="Tokens per held-out window.")

    @model_validator(mode="after")
    def _three_budgets(self):
        if len(set(self.budgets)) < 3 or min(self.budgets) <= 0:
            raise ValueError(f"give three or more distinct positive budgets, got {','.join(map(str, self.budgets))}")
        return self
