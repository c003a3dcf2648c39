"""Files the CLI reads at run time, shipped inside the package and found with importlib.resources.

    kvconvert.recipes  (the checkout's recipes/, mapped by pyproject's package-dir)
        *.yaml            built-in recipes: `kvconvert pipeline --recipe NAME`, `kvconvert heal --recipe NAME`
        heal/*.yaml       second-pass heal recipes: NAME = heal/<stem>
        gates/*.yaml      gate policies: `--policy default|smoke|strict`
        accelerate/*      `accelerate launch --config_file` configs
    kvconvert/eval/longbench-mini/   LongBench-mini, one <task>.jsonl.gz per task (its README: source, license)

kvconvert_home() is where kvconvert keeps what it makes for a user across runs (imported models,
downloads, hashes, validation results, teacher text): $KVCONVERT_HOME, default ~/.cache/kvconvert.

Nothing here looks beside the checkout: an installed wheel and an editable install find the same
files (tests/test_wheel.py builds and installs the wheel to check). A name is looked up only
when no file of that path exists, so a user's own file always wins over a built-in one.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from kvconvert.errors import KVConvertError

YAML_SUFFIXES = (".yaml", ".yml")


def kvconvert_home() -> Path:
    """$KVCONVERT_HOME, default ~/.cache/kvconvert: kvconvert's own cache (models, downloads, hashes...)."""
    return Path(os.environ.get("KVCONVERT_HOME", Path.home() / ".cache" / "kvconvert"))


def managed_models_dir() -> Path:
    """Where kvconvert keeps its imports of the built-in models (kvconvert.sources.builtin_model)."""
    return kvconvert_home() / "models"


def hub_cache_dir() -> Path:
    """The Hugging Face hub's download cache (where a hub id --src is fetched to)."""
    try:
        from huggingface_hub import constants
        return Path(constants.HF_HUB_CACHE)
    except ImportError:  # huggingface_hub's own rule: HF_HUB_CACHE, else HF_HOME/hub
        home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
        return Path(os.environ.get("HF_HUB_CACHE", Path(home) / "hub"))


def managed_folder(path: str | os.PathLike) -> str | None:
    """Which cache manages `path`, when it is, lies in or contains one that kvconvert or the hub keeps
    for every later command (None for a user's own folder). Every run that names the built-in model
    reads the same copy: a command that rewrote it would silently change the source of every later
    validate, plan and baseline, so nothing kvconvert writes may land there."""
    real = Path(path).expanduser().resolve()
    for root, what in ((managed_models_dir(), "kvconvert's imports of the built-in models ($KVCONVERT_HOME/models)"),
                       (hub_cache_dir(), "the Hugging Face hub cache")):
        root = root.expanduser().resolve()
        if real == root or root in real.parents or real in root.parents:
            return f"{what}, {root}"
    return None


def package_dir(package: str, *parts: str) -> Path:
    """A folder shipped in `package`, as a file-system path (pip installs wheels unpacked; a zipped
    import would need extracting, which nothing here does)."""
    found = resources.files(package).joinpath(*parts)
    if not isinstance(found, Path):
        raise KVConvertError(f"{package} is not installed as files on disk ({found}); install kvconvert with pip")
    return found


def recipes_dir() -> Path:
    return package_dir("kvconvert.recipes")


def gates_dir() -> Path:
    return recipes_dir() / "gates"


def longbench_mini_dir() -> Path:
    return package_dir("kvconvert.eval", "longbench-mini")


def builtin_names(folder: Path) -> list[str]:
    """The YAML stems in `folder` (a built-in name is the stem: gates/default.yaml -> default)."""
    return sorted(p.stem for p in folder.iterdir() if p.suffix in YAML_SUFFIXES) if folder.is_dir() else []


def builtin_recipe_names() -> list[str]:
    return builtin_names(recipes_dir()) + [f"heal/{n}" for n in builtin_names(recipes_dir() / "heal")]


def _builtin_file(folder: Path, name: str, prefix: str) -> Path | None:
    """folder/<name>.yaml for a name like `default`, `default.yaml` or `<prefix>/default.yaml` (the path
    the checkout's docs use), or None."""
    name = name.removeprefix(prefix)
    if Path(name).suffix in YAML_SUFFIXES:
        name = str(Path(name).with_suffix(""))
    if not name or Path(name).is_absolute() or ".." in Path(name).parts:  # names stay inside `folder`
        return None
    return next((folder / f"{name}{s}" for s in YAML_SUFFIXES if (folder / f"{name}{s}").is_file()), None)


def find_recipe(recipe: str | Path) -> Path | None:
    """A recipe file: `recipe` itself when it is a file, else the built-in recipe of that name
    (smollm2-135m-25pct, heal/smollm2-135m-25pct-fp8rope-long-2, or recipes/<name>.yaml), else None."""
    if Path(recipe).is_file():
        return Path(recipe)
    found = _builtin_file(recipes_dir(), Path(recipe).as_posix(), "recipes/")
    return found if found is not None and found.parent in (recipes_dir(), recipes_dir() / "heal") else None


def find_policy(policy: str | Path, base: Path | None = None) -> Path:
    """A gate policy file: `policy` as given, else beside `base` (a recipe's folder), else the built-in
    policy of that name (default, smoke, strict; recipes/gates/<name>.yaml works too)."""
    beside = [Path(base) / policy] if base is not None else []
    for path in (Path(policy), *beside):
        if path.is_file():
            return path
    found = _builtin_file(gates_dir(), Path(policy).as_posix(), "recipes/gates/")
    if found is None:
        raise KVConvertError(f"{policy}: policy file not found and not a built-in policy "
                             f"({', '.join(builtin_names(gates_dir()))}); give a policy YAML file or one of those names")
    return found
