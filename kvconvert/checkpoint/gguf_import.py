"""Import a GGUF file into an HF safetensors folder (through transformers + gguf, no pickle)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvconvert.checkpoint.writer import CheckpointWriter, check_output_path
from kvconvert.errors import CheckpointError
from kvconvert.kvformat import WEIGHT_DTYPES, torch_dtype



def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "fp32", overwrite: bool = False,
                source: str | None = None, managed_ok: bool = False) -> Path:
    """Dequantize a GGUF checkpoint into `out_dir` (config.json, model.safetensors, tokenizer).

    transformers reads the GGUF metadata, builds the matching config and tokenizer and
    dequantizes the weights; we write them with our atomic writer. managed_ok: out_dir is kvconvert's
    own import of a built-in model (kvconvert.sources), the one writer allowed there.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    check_output_path(out_dir.absolute(), overwrite, sources=(gguf_path,), managed_ok=managed_ok)  # before the load
    if not gguf_path.is_file():
        raise CheckpointError(f"{gguf_path}: GGUF file not found")
    if dtype not in WEIGHT_DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch_dtype(dtype))
    except Exception as exc:  # gguf / transformers raise many types for a bad file
        raise CheckpointError(f"{gguf_path}: cannot import GGUF ({type(exc).__name__}: {exc})") from None
    staging = out_dir.parent / f".{out_dir.name}.hf-staging"
    try:
        tokenizer.save_pretrained(str(staging))
        _write_hf_folder(model, staging, out_dir, dtype, overwrite, source or str(gguf_path), gguf_path.name, managed_ok)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _write_hf_folder(model, staging: Path, out_dir: Path, dtype: str, overwrite: bool, source: str,
                     gguf_name: str, managed_ok: bool = False) -> None:
    config = model.config.to_dict()
    # The weights are dequantized: drop transformers' GGUF marker and local paths, name the class.
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "id2label", "label2id"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = WEIGHT_DTYPES[dtype].torch_name
    with CheckpointWriter(out_dir, overwrite=overwrite, source=source,
                          manifest_extra={"imported_from": gguf_name}, managed_ok=managed_ok) as w:
        for name, tensor in model.state_dict().items():
            if config.get("tie_word_embeddings") and name == "lm_head.weight":
                continue  # tied: transformers re-ties it from the embeddings
            w.add(name, tensor)
        w.write_config(config)
        if model.generation_config is not None:
            w.write_json("generation_config.json", json.loads(model.generation_config.to_json_string()))
        w.copy_tokenizer(staging)
