"""`kvconvert pipeline --recipe`: every recipe block becomes flags of the real commands."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvconvert.cli import cli
from kvconvert.errors import KVConvertError
from kvconvert.mla.cli import mla_cmd
from kvconvert.pipeline import recipe_stages
from kvconvert.quant.cli import calibrate_cmd
from kvconvert.recipe import CalibrateStage, ConvertStage, load_recipe, parse_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
# recipe key -> the click parameter that receives it (where the names differ)
CONVERT_PARAM: dict[str, str] = {}
CALIBRATE_PARAM: dict[str, str] = {}

EVERY_CONVERT_KEY = {"rank": 48, "rope_dim": 16, "q_rank": 96, "calib_data": "essays", "calib_tokens": 1024,
                     "calib_window": 256, "dtype": "fp32", "key_weight": 0.5, "rho": 1e-3, "stream": "source",
                     "target": "any", "refit_o_proj": False}
EVERY_CALIBRATE_KEY = {"kv_dtype": "nvfp4", "observer": "percentile", "granularity": "head", "percentile": 99.9,
                       "rotate": True, "key_phase": False, "value_rotation": False, "rotation_block": 32,
                       "key_strength": 0.5, "search_tokens": 0, "calib_data": "essays", "calib_tokens": 2048,
                       "format": "both"}


def _parse(command, args: list[str]) -> dict:
    """The parameters the real click command receives for `args` (parsed, not run)."""
    return command.make_context(command.name, list(args)).params


def _expected(key, value, rename):
    return (rename.get(key, key), value)


def test_every_recipe_key_is_a_flag_of_its_command():
    """The commands' options are generated from the recipe blocks' models (kvconvert.stage_options)."""
    assert set(ConvertStage.model_fields) - {"enabled"} <= {p.name for p in mla_cmd.params}
    assert set(CalibrateStage.model_fields) - {"enabled"} <= {p.name for p in calibrate_cmd.params}


def test_every_key_reaches_the_commands_with_its_value(tmp_path):
    recipe = parse_recipe({"convert": EVERY_CONVERT_KEY, "calibrate": EVERY_CALIBRATE_KEY,
                           "validate": {"suite": "smoke", "gate": "smoke"}}, "r.yaml")
    stages, kv_dtype, policy = recipe_stages(recipe, tmp_path / "r.yaml", "smollm2-135m", tmp_path / "out")
    (name_c, conv), (name_k, cal) = stages
    assert (name_c, name_k, kv_dtype, Path(policy).name) == ("convert", "calibrate", "nvfp4", "smoke.yaml")
    params = _parse(mla_cmd, conv[1:])
    for key, value in EVERY_CONVERT_KEY.items():
        pname, want = _expected(key, value, CONVERT_PARAM)
        assert params[pname] == want, key
    assert params["heal"] == "none" and params["out_dir"] == tmp_path / "out" / "mla"
    params = _parse(calibrate_cmd, cal[1:])
    for key, value in EVERY_CALIBRATE_KEY.items():
        pname, want = _expected(key, value, CALIBRATE_PARAM)
        assert params[pname] == pytest.approx(want) if isinstance(want, float) else params[pname] == want, key
    assert params["src"] == str(tmp_path / "out" / "mla")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_make_valid_commands(path, tmp_path):
    recipe = load_recipe(path)
    if recipe.convert is None:
        pytest.skip("no convert block")
    stages, _, policy = recipe_stages(recipe, path, recipe.source or "smollm2-135m", tmp_path)
    assert Path(policy).is_file()
    conv = _parse(mla_cmd, stages[0][1][1:])
    assert conv["rank"] == recipe.convert.rank
    assert conv["heal"] == (str(path) if recipe.heals() else "none")
    for _, args in stages[1:]:
        _parse(calibrate_cmd, args[1:])


def test_unset_keys_take_the_commands_defaults(tmp_path):
    recipe = parse_recipe({"convert": {"rank": 64}, "calibrate": {}}, "r.yaml")
    stages, kv_dtype, _ = recipe_stages(recipe, tmp_path / "r.yaml", "smollm2-135m", tmp_path)
    from kvconvert.mla.options import MLAOptions
    from kvconvert.stage_options import build_options

    # the printed command builds the same options as the recipe, and both take the model's defaults
    cli_opts = build_options(MLAOptions, _parse(mla_cmd, stages[0][1][1:]))
    assert cli_opts == recipe.convert.mla_options() == MLAOptions(rank=64)
    assert stages[0][1][1:4] == ["--src", "smollm2-135m", "--rank"] and "--key-weight" not in stages[0][1]
    assert kv_dtype == "fp8" and stages[1][1][stages[1][1].index("--kv-dtype") + 1] == "fp8"


def test_recipe_without_calibrate_validates_the_unquantized_model(tmp_path):
    recipe = parse_recipe({"convert": {"rank": 64}}, "r.yaml")
    stages, kv_dtype, _ = recipe_stages(recipe, tmp_path / "r.yaml", "smollm2-135m", tmp_path)
    assert [s for s, _ in stages] == ["convert"] and kv_dtype == "auto"


def test_recipe_needs_a_convert_or_calibrate_block(tmp_path):
    with pytest.raises(KVConvertError, match="needs a `convert` or a `calibrate` block"):
        recipe_stages(parse_recipe({"validate": {}}, "r.yaml"), tmp_path / "r.yaml", "x", tmp_path)
    with pytest.raises(KVConvertError, match="heal blocks need a `convert` block"):
        recipe_stages(parse_recipe({"heal_layerwise": {}, "calibrate": {}}, "r.yaml"), tmp_path / "r.yaml", "x", tmp_path)


def test_calibrate_only_recipe_quantizes_the_source(tmp_path):
    """No convert block: "don't convert, just quantize" - calibrate runs on the source itself."""
    stages, kv_dtype, _ = recipe_stages(parse_recipe({"calibrate": {"kv_dtype": "nvfp4"}}, "r.yaml"),
                                        tmp_path / "r.yaml", "smollm2-135m", tmp_path)
    (name, args), = stages
    params = _parse(calibrate_cmd, args[1:])
    assert (name, kv_dtype, params["src"], params["out"]) == ("calibrate", "nvfp4", "smollm2-135m",
                                                              str(tmp_path / "source-nvfp4"))


def test_no_mla_flag_refuses_conversion_flags(tmp_path):
    result = CliRunner().invoke(cli, ["pipeline", "--no-mla", "--rank", "256", "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, KVConvertError) and "--rank: belong to the MLA conversion" in str(result.exception)
    result = CliRunner().invoke(cli, ["pipeline", "--no-mla", "--kv-dtype", "bf16", "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, KVConvertError) and "nothing to build" in str(result.exception)


def test_flags_the_recipe_owns_are_refused_before_any_work(tmp_path):
    recipe = ROOT / "recipes" / "smollm2-135m-25pct.yaml"
    result = CliRunner().invoke(cli, ["pipeline", "--recipe", str(recipe), "--rank", "32", "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, KVConvertError) and "--rank: set by the recipe" in str(result.exception)
    assert not (tmp_path / "o").exists()
    result = CliRunner().invoke(cli, ["pipeline", "--recipe", str(recipe), "--src", "other", "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, KVConvertError) and "the recipe's source is smollm2-135m" in str(result.exception)


def test_recipe_kv_dtypes_are_the_calibrators():
    from typing import get_args

    from kvconvert.quant.options import KV_DTYPES

    assert set(get_args(CalibrateStage.model_fields["kv_dtype"].annotation)) == set(KV_DTYPES)


def test_flag_pipeline_builds_the_same_commands_as_a_recipe(tmp_path):
    from kvconvert.pipeline import _from_flags

    stages = _from_flags("smollm2-135m", 160, 32, "any", "layerwise", 2048, "fp8", tmp_path)
    conv, cal = (_parse(cmd, args[1:]) for cmd, (_, args) in zip((mla_cmd, calibrate_cmd), stages))
    assert (conv["rank"], conv["rope_dim"], conv["calib_tokens"], conv["heal"]) == (160, 32, 2048, "layerwise")
    assert (cal["kv_dtype"], cal["calib_tokens"], cal["out"]) == ("fp8", 2048, str(tmp_path / "mla-fp8"))
    assert (conv["target"]) == "any"
    assert [s for s, _ in _from_flags("x", 64, 32, "any", "none", None, "bf16", tmp_path)] == ["convert"]
