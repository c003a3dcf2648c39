"""Recipes: one YAML file that says how to build a checkpoint, one top-level block per stage.

    name: smollm2-135m-25pct
    convert:        {rank: 64, rope_dim: 32, dtype: fp32}           # kvconvert mla (mla/options.py)
    heal_layerwise: {tokens: 16384, window: 512, steps: 120}        # fit each attention block (heal/options.py)
    heal_distill:   {tokens: 200000, seq_len: 512, lr: 1.0e-3}      # end-to-end KL to the source
    calibrate:      {kv_dtype: fp8}                                 # KV-cache scales (quant/options.py)
    validate:       {suite: quick, gate: default}                   # eval/options.py + the gate policy (name or YAML)

Every block is optional; a block that is present runs (set `enabled: false` to keep it written
down but skip it). Unknown keys are errors that name the key and the file (pydantic extra=forbid),
so a typo never silently falls back to a default.

The built-in recipes (the checkout's recipes/, installed as kvconvert.recipes) are found by name
wherever kvconvert is installed: `--recipe smollm2-135m-25pct`, `--recipe heal/NAME` (kvconvert.resources).

heal(student, teacher, recipe, out) runs a recipe's two heal blocks (kvconvert.heal.api.heal_stages
takes their options; the heal package itself never reads a recipe: it sits below this module).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from kvconvert.errors import KVConvertError
from kvconvert.eval.options import ValidateOptions
from kvconvert.heal.options import HEAL_BLOCKS, DistillOptions, LayerwiseOptions, without_device
from kvconvert.mla.options import MLAOptions
from kvconvert.quant.options import CalibrateOptions
from kvconvert.resources import builtin_recipe_names, find_recipe
from kvconvert.stage_options import StageOptions, read_yaml, validation_problems

# Built-in heal recipes (`kvconvert heal --recipe NAME`, `kvconvert mla --heal NAME`).
HEAL_PRESETS: dict[str, dict] = {
    # Layer-wise reconstruction alone: CPU-sized (SmolLM2-135M: ~10-20 min on 2 cores).
    "layerwise": {"name": "layerwise", "heal_layerwise": {}},
    # Layer-wise, then a short distillation.
    "layerwise+distill": {"name": "layerwise+distill", "heal_layerwise": {}, "heal_distill": {}},
    # Distillation alone: a model of the teacher's own architecture healed for its KV cache (--distill-kv-dtype),
    # which has no converted block to reconstruct.
    "distill": {"name": "distill", "heal_distill": {}},
}


def _block(name: str, options: type[StageOptions], **fields) -> type[StageOptions]:
    """A recipe block: its stage's options model (defined once, beside the stage) plus `enabled` and
    `fields`. A key left out takes the stage's default, the one its command shows, because there is only one."""
    return create_model(name, __base__=options, enabled=(bool, True), **fields)


ConvertStage = _block("ConvertStage", MLAOptions)
LayerwiseStage = _block("LayerwiseStage", LayerwiseOptions)
DistillStage = _block("DistillStage", DistillOptions)
CalibrateStage = _block("CalibrateStage", CalibrateOptions)
# gate: the pipeline's gate policy, a YAML path or a built-in name (recipes/gates/, kvconvert.resources.find_policy)
ValidateStage = _block("ValidateStage", ValidateOptions, gate=(str | None, None))


def stage_options(block: StageOptions | None) -> StageOptions | None:
    """The stage options of a recipe block (its keys, without the recipe's own), or None when the
    block is absent or disabled."""
    if block is None or not block.enabled:
        return None
    model = type(block).__base__
    return model(**{k: v for k, v in block.model_dump(exclude_unset=True).items() if k in model.model_fields})


def heal_cache_mismatch(distill: DistillOptions | None, calibrate: CalibrateOptions | None) -> str | None:
    """Why a quantization-aware heal (distill.kv_dtype) does not match the cache that `calibrate` stores, or None.

    The heal teaches the student one format's rounding in the default Hadamard basis (kvconvert.heal.quant_aware),
    so calibrate must store that format with its default rotation and no latent shaping given (calibrate's
    default shaping stays off on a checkpoint healed this way: kvconvert.quant.run.keep_heal_basis)."""
    if distill is None or distill.kv_dtype is None or calibrate is None:
        return None
    if calibrate.kv_dtype != distill.kv_dtype:
        return (f"heal_distill.kv_dtype is {distill.kv_dtype} but calibrate.kv_dtype is {calibrate.kv_dtype}: the "
                f"student would be healed for another cache format than the one calibrated; give both the same kv_dtype")
    unshaped = {"latent_shaping": 0.0}
    if (calibrate.model_copy(update=unshaped).latent_rotation
            != CalibrateOptions(kv_dtype=calibrate.kv_dtype, **unshaped).latent_rotation
            or (calibrate.latent_shaping or 0.0) > 0):
        return ("calibrate's rotate / value_rotation / rotation_block / latent_shaping change how the latent is stored, but "
                "heal_distill.kv_dtype rounds the cache in calibrate's default Hadamard; leave them at their "
                "defaults, or drop heal_distill.kv_dtype")
    return None


def source_heal_problem(layerwise: LayerwiseOptions | None, distill: DistillOptions | None) -> str | None:
    """Why a pipeline's heal blocks cannot heal the source itself (its recipe has no `convert` block), or None.

    Without a conversion the student is the source, healed for its KV cache: only a quantization-aware
    distillation (heal_distill.kv_dtype) has anything to teach it. heal_layerwise fits an MLA conversion's layers
    to the source's; for the source itself its loss is zero from the first step."""
    if layerwise is not None:
        return ("heal_layerwise fits an MLA conversion's layers to its source's and needs a `convert` block; a "
                "source healed for its KV cache takes heal_distill with kv_dtype only")
    if distill is not None and distill.kv_dtype is None:
        return ("heal_distill without kv_dtype and without a `convert` block distills the source against itself, "
                "which teaches it nothing: give heal_distill.kv_dtype (the cache it is healed for, the calibrate "
                "block's kv_dtype), or add a `convert` block")
    return None


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

    @model_validator(mode="after")
    def _one_cache_format(self):
        problem = heal_cache_mismatch(self.distill, self.stage("calibrate"))
        if problem:
            raise ValueError(problem)
        return self

    def stage(self, name: str):
        """The options of block `name` (convert, heal_layerwise, heal_distill, calibrate, validate),
        or None when the recipe has no such block or it is disabled."""
        return stage_options(getattr(self, "validate_" if name == "validate" else name))

    @property
    def layerwise(self) -> LayerwiseOptions | None:
        return self.stage("heal_layerwise")

    @property
    def distill(self) -> DistillOptions | None:
        return self.stage("heal_distill")

    def heals(self) -> bool:
        return self.layerwise is not None or self.distill is not None

    def to_dict(self) -> dict:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def parse_recipe(data: object, origin: str = "<recipe>") -> Recipe:
    """A Recipe from a parsed YAML/JSON object; every error names the key and `origin`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise KVConvertError(f"{origin}: a recipe must be a mapping of stages (convert, heal_layerwise, ...), got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise KVConvertError(f"{origin}: invalid recipe: {validation_problems(exc, Recipe)}") from None


def resolve_recipe(recipe: Recipe | dict | str | Path) -> Recipe:
    """A Recipe from a Recipe, a dict, a preset name (layerwise, layerwise+distill), a YAML path or
    a built-in recipe's name (kvconvert.resources.find_recipe)."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, dict):
        return parse_recipe(recipe)
    if str(recipe) in HEAL_PRESETS:
        return parse_recipe(HEAL_PRESETS[str(recipe)], f"preset {recipe}")
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") or path.exists() or find_recipe(path) is not None:
        return load_recipe(path)
    raise KVConvertError(f"{recipe}: not a recipe file or preset (presets: {', '.join(HEAL_PRESETS)}; built-in "
                         f"recipes: {', '.join(builtin_recipe_names())})")


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe YAML file, or the built-in recipe of that name when no such file exists."""
    found = find_recipe(path)
    if found is None and not Path(path).is_file():
        raise KVConvertError(f"{path}: recipe file not found and not a built-in recipe "
                             f"({', '.join(builtin_recipe_names())})")
    return parse_recipe(read_yaml(found or path, "recipe file not found"), str(found or path))


def heal_blocks(recipe: Recipe) -> dict:
    """The recipe's heal blocks as it dumps them, each without its device (it moves the work, not what is made):
    what a heal stage's provenance records, so the pipeline reuses a heal only for the same blocks."""
    return {b: v for b, v in without_device(recipe.to_dict()).items() if b in HEAL_BLOCKS}


def with_heal_device(recipe: Recipe, device: str | None) -> Recipe:
    """The recipe with every heal block's device set to `device` (checked by the options model), or
    unchanged when device is None."""
    if device is None:
        return recipe
    data = recipe.to_dict()
    for block in HEAL_BLOCKS:
        if block in data:
            data[block] = {**data[block], "device": str(device)}
    return parse_recipe(data, f"--device {device}")


def heal(student: str | Path, teacher: str | Path, recipe: Recipe | dict | str | Path, out: str | Path, *,
         overwrite: bool = False, progress: bool = True, restart: bool = False, max_steps: int | None = None,
         device: str | None = None, allow_other_teacher: bool = False) -> dict:
    """Heal `student` (a `kvconvert mla` output) against `teacher` (its source) into `out` with the
    heal_layerwise / heal_distill blocks of `recipe` (a Recipe, dict, preset name, YAML path or
    built-in recipe: resolve_recipe), run by kvconvert.heal.api.heal_stages.

    max_steps: stop the distillation after this many optimizer steps, keep the state and return
    {"finished": False} (rerun to resume). restart: discard any saved state first. device: where
    both stages (and the teacher's data generation) run, replacing the recipe blocks' `device`
    (None: each block's own, default auto = cuda when a GPU is visible, else cpu). allow_other_teacher: heal
    against a teacher other than the weights the student was converted from (refused otherwise). Returns the report.
    """
    from kvconvert.heal.api import heal_stages  # torch and transformers: loaded only when a heal runs

    return heal_stages(student, teacher, with_heal_device(resolve_recipe(recipe), device), out, overwrite=overwrite,
                       progress=progress, restart=restart, max_steps=max_steps,
                       allow_other_teacher=allow_other_teacher)
