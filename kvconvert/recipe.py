"""Recipes: one YAML file that says how to build a checkpoint, one top-level block per stage.

    name: smollm2-135m-25pct
    convert:        {rank: 64, rope_dim: 32, dtype: fp32}           # kvconvert mla (mla/options.py)
    heal_layerwise: {tokens: 16384, window: 512, steps: 120}        # fit each attention block
    heal_distill:   {tokens: 200000, seq_len: 512, lr: 1.0e-3}      # end-to-end KL to the source
    calibrate:      {kv_dtype: fp8}                                 # KV-cache scales
    validate:       {suite: quick, gate: recipes/gates/default.yaml}

Every block is optional; a block that is present runs (set `enabled: false` to keep it written
down but skip it). Unknown keys are errors that name the key and the file (pydantic extra=forbid),
so a typo never silently falls back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import VALIDATE_KV_DTYPES
from kvconvert.mla.options import MLAOptions
from kvconvert.quant.options import CalibrateOptions

# Attention projections that can train; those a checkpoint lacks are skipped (q_proj, or the
# low-rank query pair q_a_proj / q_b_proj when the conversion used q_lora_rank).
TRAINABLE_ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
AttentionName = Literal["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


class _Stage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True

    def options(self) -> dict:
        """The keys this block sets, without `enabled`; a None key is left to the command's default."""
        return self.model_dump(exclude={"enabled"}, exclude_none=True)


class ConvertStage(MLAOptions):
    """The `convert` block is kvconvert.mla.options.MLAOptions itself (rank = kv_lora_rank, rope_dim =
    qk_rope_head_dim, q_rank = q_lora_rank, ...): a key left out takes the converter's default, the
    one `kvconvert mla` shows, because there is only one."""

    enabled: bool = True

    def options(self) -> dict:
        """The keys this block sets (what a printed command line needs), without `enabled`."""
        return self.model_dump(exclude={"enabled"}, exclude_unset=True)

    def mla_options(self) -> MLAOptions:
        return MLAOptions(**self.model_dump(exclude={"enabled"}))


class LayerwiseStage(_Stage):
    """Layer-wise reconstruction of each converted attention block (kvconvert.heal.layerwise).

    target: what the student block is fitted to, per layer i (x = normed block input):
      student_input     teacher block at the student's own input: min |A_s(x_s) - A_t(x_s)|
      teacher_input     both at the teacher's input:               min |A_s(x_t) - A_t(x_t)|
      student_residual  student input, teacher stream output:      min |h_s + A_s(x_s) - (h_t + A_t(x_t))|
                        (also repairs the drift left by earlier layers)
    steps: Adam steps per layer; batch_windows: calibration windows per step; lr: relative step
    (each weight is optimised in units of its own RMS, so one lr fits every tensor).
    refit_o_proj: finish each layer with a least-squares o_proj (exact optimum given the rest).
    """

    data: str = "builtin"
    tokens: int = Field(32768, gt=0)
    window: int = Field(512, gt=0)
    steps: int = Field(100, ge=0)
    batch_windows: int = Field(1, gt=0)
    lr: float = Field(5e-3, gt=0)
    target: Literal["student_input", "teacher_input", "student_residual"] = "student_input"
    refit_o_proj: bool = True
    train: tuple[AttentionName, ...] = TRAINABLE_ATTENTION
    seed: int = 0

    @model_validator(mode="after")
    def _enough_windows(self):
        if self.tokens < self.window:
            raise ValueError(f"tokens ({self.tokens}) is less than one window ({self.window})")
        return self


class DistillStage(_Stage):
    """End-to-end distillation: KL(teacher || student) on next-token distributions (+ lm_weight x CE,
    + hidden_weight x the mean over layers of |h_s - h_t|^2 / |h_t|^2, the residual streams).

    tokens: training tokens in total (steps = tokens / (batch_size x seq_len x grad_accum)).
    train: full (the attention weights themselves) or lora (low-rank deltas merged at the end).
    lr is relative (weights are optimised in units of their RMS, like the layer-wise stage).
    mixed_precision: accelerate's setting (no | bf16 | fp16); on a CPU keep `no`.
    gradient_checkpointing: recompute activations in the backward pass (long seq_len on a GPU).
    max_epochs: how many times the data may be reused when it holds fewer than `tokens` tokens.
    checkpoint_every: optimizer steps between resumable snapshots (0 = only at the end).
    """

    data: str = "builtin"
    tokens: int = Field(65536, gt=0)
    seq_len: int = Field(512, gt=0)
    batch_size: int = Field(1, gt=0)
    grad_accum: int = Field(1, gt=0)
    lr: float = Field(5e-4, gt=0)
    warmup_steps: int = Field(10, ge=0)
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    kl_weight: float = Field(1.0, ge=0)
    lm_weight: float = Field(0.0, ge=0)
    hidden_weight: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    train: Literal["full", "lora"] = "full"
    lora_rank: int = Field(16, gt=0)
    lora_alpha: float = Field(16.0, gt=0)
    targets: tuple[AttentionName, ...] = TRAINABLE_ATTENTION
    max_grad_norm: float = Field(1.0, gt=0)
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    gradient_checkpointing: bool = False
    max_epochs: int = Field(1, gt=0)
    checkpoint_every: int = Field(50, ge=0)
    log_every: int = Field(1, gt=0)
    seed: int = 0

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


class CalibrateStage(CalibrateOptions):
    """The `calibrate` block is kvconvert.quant.options.CalibrateOptions itself (the options of
    `kvconvert calibrate`): a key left out takes the one default there is."""

    enabled: bool = True

    def options(self) -> dict:
        return self.model_dump(exclude={"enabled"}, exclude_unset=True)

    def calibrate_options(self) -> CalibrateOptions:
        return CalibrateOptions(**self.model_dump(exclude={"enabled"}))


class ValidateStage(_Stage):
    """Validation against the source (kvconvert validate) and an optional gate policy."""

    suite: Literal["smoke", "quick", "standard", "full"] = "quick"
    engine: Literal["auto", "runtime", "transformers"] = "auto"
    kv_dtype: Literal[VALIDATE_KV_DTYPES] = "auto"
    gate: str | None = None  # path of a gate policy YAML (recipes/gates/*.yaml)


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    description: str | None = None
    source: str | None = None  # default teacher / conversion source (HF folder or built-in name)
    convert: ConvertStage | None = None
    heal_layerwise: LayerwiseStage | None = None
    heal_distill: DistillStage | None = None
    calibrate: CalibrateStage | None = None
    validate_: ValidateStage | None = Field(None, alias="validate")

    @property
    def layerwise(self) -> LayerwiseStage | None:
        return self.heal_layerwise if self.heal_layerwise and self.heal_layerwise.enabled else None

    @property
    def distill(self) -> DistillStage | None:
        return self.heal_distill if self.heal_distill and self.heal_distill.enabled else None

    def heals(self) -> bool:
        return self.layerwise is not None or self.distill is not None

    def to_dict(self) -> dict:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def _describe(err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(err["loc"][:-1])
        return f"unknown key {loc!r}" + (f" (allowed here: {', '.join(allowed)})" if allowed else "")
    return f"{loc}: {err['msg']}"


def _allowed_keys(parent: tuple) -> list[str]:
    """The keys a recipe block accepts, as written in YAML (aliases such as `validate`)."""
    import typing

    model = Recipe
    for part in parent:
        fields = {f.alias or name: f for name, f in model.model_fields.items()}
        if part not in fields:
            return []
        args = [a for a in typing.get_args(fields[part].annotation) if isinstance(a, type)] or [fields[part].annotation]
        model = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return []
    return [f.alias or name for name, f in model.model_fields.items()]


def parse_recipe(data: object, origin: str = "<recipe>") -> Recipe:
    """A Recipe from a parsed YAML/JSON object; every error names the key and `origin`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise KVConvertError(f"{origin}: a recipe must be a mapping of stages (convert, heal_layerwise, ...), got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(_describe(e) for e in exc.errors()[:3])
        more = f" (+{exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
        raise KVConvertError(f"{origin}: invalid recipe: {problems}{more}") from None


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe YAML file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise KVConvertError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise KVConvertError(f"{path}: not valid YAML{where}") from None
    return parse_recipe(data, str(path))
