"""Built-in recipes and gate policies by name (kvconvert.resources); the installed-wheel side is tests/test_wheel.py."""

from pathlib import Path

import pytest

from kvconvert import resources as R
from kvconvert.errors import KVConvertError
from kvconvert.recipe import load_recipe, resolve_recipe

CHECKOUT_RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_every_checkout_recipe_and_policy_is_built_in(tmp_path, monkeypatch):
    """From another folder, each YAML of recipes/ (and heal/) resolves by name, and each policy of recipes/gates/."""
    monkeypatch.chdir(tmp_path)
    recipes = sorted(CHECKOUT_RECIPES.glob("*.yaml")) + sorted(CHECKOUT_RECIPES.glob("heal/*.yaml"))
    names = [str(p.relative_to(CHECKOUT_RECIPES).with_suffix("")) for p in recipes]
    assert sorted(names) == sorted(R.builtin_recipe_names())
    for name, path in zip(names, recipes):
        for given in (name, f"{name}.yaml", f"recipes/{name}.yaml"):
            assert R.find_recipe(given).read_bytes() == path.read_bytes(), given
    assert load_recipe("smollm2-135m-25pct") == load_recipe(CHECKOUT_RECIPES / "smollm2-135m-25pct.yaml")
    for path in CHECKOUT_RECIPES.glob("gates/*.yaml"):
        for given in (path.stem, path.name, f"recipes/gates/{path.name}"):
            assert R.find_policy(given).read_bytes() == path.read_bytes(), given


def test_a_users_file_wins_and_names_stay_inside(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").write_text("thresholds: {kl_mean: 0.1}\n")
    assert R.find_policy("default") == Path("default")  # the file given, not the built-in
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mine.yaml").write_text("thresholds: {kl_mean: 0.1}\n")
    assert R.find_policy("mine.yaml", base=tmp_path / "sub") == tmp_path / "sub" / "mine.yaml"  # beside a recipe
    for not_a_recipe in ("gates/default", "accelerate/fsdp", "../recipes/smollm2-135m-25pct", "/smollm2-135m-25pct"):
        assert R.find_recipe(not_a_recipe) is None, not_a_recipe
    with pytest.raises(KVConvertError, match=r"defualt: policy file not found and not a built-in policy \(default, "
                                             r"smoke, strict\)"):
        R.find_policy("defualt")
    with pytest.raises(KVConvertError, match="not a built-in recipe .*smollm2-135m-25pct"):
        load_recipe("smollm2-135m-25pct-typo")
    with pytest.raises(KVConvertError, match="not a recipe file or preset .*built-in recipes: .*heal/"):
        resolve_recipe("layerwize")
