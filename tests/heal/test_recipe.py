"""Recipe schema: shipped recipes load; unknown keys and bad values name the key and the file."""

from pathlib import Path

import pytest

from kvconvert.errors import KVConvertError
from kvconvert.recipe import load_recipe, parse_recipe

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


def test_recipes_are_shipped():
    names = {p.name for p in RECIPES}
    for pct in (50, 33, 25, 12):
        assert f"smollm2-135m-{pct}pct.yaml" in names
    assert {"llama-2-7b-mla512.yaml", "llama-3.1-8b-mla512.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipe_converts_its_source(path):
    """Every shipped recipe heals, and its conversion shape passes the converter's own plan check
    (rope_dim fits the head, the target engine serves the latent) for the model it names; a recipe without a
    conversion heals the source itself for the cache it calibrates (what the pipeline accepts)."""
    from kvconvert.mla.convert import validate_plan
    from kvconvert.presets import get_preset
    from kvconvert.recipe import source_heal_problem

    recipe = load_recipe(path)
    assert recipe.heals()
    if recipe.stage("convert") is None:
        assert source_heal_problem(recipe.layerwise, recipe.distill) is None
        assert recipe.distill.kv_dtype == recipe.stage("calibrate").kv_dtype
        return
    preset = recipe.source.split("/")[-1].lower().removesuffix("-hf")
    validate_plan(get_preset(preset)["config"], recipe.stage("convert"))


HEAL_ONLY = sorted((Path(__file__).parents[2] / "recipes" / "heal").glob("*.yaml"))


@pytest.mark.parametrize("path", HEAL_ONLY, ids=lambda p: p.name)
def test_shipped_heal_only_recipe_heals_and_converts_nothing(path):
    """recipes/heal/: `kvconvert heal --recipe` on an already converted checkpoint (a second pass)."""
    recipe = load_recipe(path)
    assert recipe.heals() and recipe.stage("convert") is None


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, match", [
    ("heal_layerwise:\n  steps: 10\n  stpes: 20\n", r"unknown key 'heal_layerwise\.stpes'"),
    ("heal_distil:\n  tokens: 100\n", r"unknown key 'heal_distil'"),
    ("convert:\n  rank: -3\n", r"convert\.rank"),
    ("heal_layerwise:\n  target: teacher\n", r"heal_layerwise\.target"),
    ("heal_distill:\n  kl_weight: 0\n  lm_weight: 0\n", "nothing to train"),
    ("convert: [rank: 3\n", "not valid YAML"),
    ("[1, 2]\n", "a recipe must be a mapping"),
    (None, "recipe file not found"),
    ("heal_distill:\n  kv_dtype: nvfp4\ncalibrate:\n  kv_dtype: fp8\n", "healed for another cache format"),
    ("heal_distill:\n  kv_dtype: int4\n", r"heal_distill\.kv_dtype"),
    ("heal_distill:\n  kv_dtype: nvfp4\ncalibrate:\n  kv_dtype: nvfp4\n  value_rotation: false\n",
     "calibrate's default Hadamard"),
], ids=["stage-key", "top-level-key", "bad-value", "bad-choice", "no-loss", "yaml", "not-a-mapping", "missing",
        "heal-and-calibrate-formats-differ", "unknown-heal-format", "heal-and-calibrate-rotations-differ"])
def test_bad_recipe_names_the_file_and_the_key(tmp_path, text, match):
    path = tmp_path / "recipe.yaml" if text is None else _write(tmp_path, text)
    with pytest.raises(KVConvertError, match=match) as info:
        load_recipe(path)
    assert str(info.value).startswith(f"{path}:")


def test_all_five_stages_and_derived_values():
    recipe = parse_recipe({
        "convert": {"rank": 64, "rope_dim": 32, "dtype": "fp32"},
        "heal_layerwise": {"steps": 5},
        "heal_distill": {"tokens": 4096, "seq_len": 512, "batch_size": 2, "grad_accum": 2},
        "calibrate": {"kv_dtype": "nvfp4"},
        "validate": {"suite": "smoke"},
    })
    assert recipe.distill.steps == 2 and recipe.distill.tokens_per_step == 2048
    assert recipe.validate_.suite == "smoke" and recipe.calibrate.kv_dtype == "nvfp4"
    opts = recipe.stage("convert")
    assert (opts.rank, opts.rope_dim, opts.dtype) == (64, 32, "fp32")
    assert recipe.to_dict()["validate"]["suite"] == "smoke"


def test_disabled_stage_does_not_run():
    recipe = parse_recipe({"heal_layerwise": {"enabled": False}})
    assert recipe.layerwise is None and not recipe.heals()


def _heal_flags(*flags: str) -> dict:
    from kvconvert.commands.heal import heal_cmd

    return heal_cmd.make_context("heal", ["--student", "s", "--teacher", "t", "--recipe", "r", "--out", "o",
                                          *flags]).params


def test_heal_flags_replace_single_keys_of_the_recipe(tmp_path):
    from kvconvert.commands.heal import recipe_with_flags

    path = _write(tmp_path, "heal_layerwise:\n  tokens: 4096\n  steps: 10\n")
    recipe = recipe_with_flags(str(path), _heal_flags("--layerwise-steps", "7", "--layerwise-train", "q_proj,o_proj"))
    assert (recipe.layerwise.steps, recipe.layerwise.train, recipe.layerwise.tokens) == (7, ("q_proj", "o_proj"), 4096)
    assert recipe_with_flags("layerwise", _heal_flags()) == parse_recipe({"name": "layerwise", "heal_layerwise": {}})
    with pytest.raises(KVConvertError, match="--distill-lr: the recipe layerwise has no enabled heal_distill block"):
        recipe_with_flags("layerwise", _heal_flags("--distill-lr", "0.1"))
    with pytest.raises(KVConvertError, match=r"--layerwise-train: Input should be 'q_proj'"):
        recipe_with_flags("layerwise", _heal_flags("--layerwise-train", "q_proj,x_proj"))
    with pytest.raises(KVConvertError, match=r"tokens \(100\) is less than one window \(512\)"):
        recipe_with_flags("layerwise", _heal_flags("--layerwise-tokens", "100"))


def test_quant_aware_heal_accepts_calibrates_default_rotation_however_spelled():
    for calibrate in ({}, {"rotate": True}, {"value_rotation": True}, {"key_phase": False}):
        recipe = parse_recipe({"heal_distill": {"kv_dtype": "nvfp4"}, "calibrate": {"kv_dtype": "nvfp4", **calibrate}})
        assert recipe.distill.kv_dtype == "nvfp4"
    # fp8 stores the latent unrotated: no rotation matches, a forced one does not
    parse_recipe({"heal_distill": {"kv_dtype": "fp8"}, "calibrate": {"kv_dtype": "fp8", "rotate": False}})
    with pytest.raises(KVConvertError, match="default Hadamard"):
        parse_recipe({"heal_distill": {"kv_dtype": "fp8"}, "calibrate": {"kv_dtype": "fp8", "value_rotation": True}})
