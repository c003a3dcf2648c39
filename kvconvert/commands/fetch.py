"""`kvconvert fetch` and `kvconvert import-gguf`: models into the local cache (kvconvert.sources)."""

from __future__ import annotations

from pathlib import Path

import click

from kvconvert.commands.options import click_options
from kvconvert.errors import KVConvertError
from kvconvert.sources import BUILTIN_MODELS, DEFAULT_MODEL, ImportOptions, resolve_source
from kvconvert.stage_options import build_options


@click.command("fetch")
@click.argument("name", required=False, default=DEFAULT_MODEL)
@click_options(ImportOptions)
def fetch_cmd(name, **params):
    """Put a built-in model (default smollm2-135m) into the cache and print its folder."""
    if name.lower() not in BUILTIN_MODELS and "/" not in name:
        raise KVConvertError(f"{name}: not a built-in model; built-in: {', '.join(sorted(BUILTIN_MODELS))}")
    click.echo(str(resolve_source(name, dtype=build_options(ImportOptions, params).dtype)))


@click.command("import-gguf")
@click.argument("gguf_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output folder (HF format, safetensors).")
@click_options(ImportOptions)
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
def import_gguf_cmd(gguf_file, out_dir, overwrite, **params):
    """Dequantize a GGUF file into a Hugging Face safetensors folder (config, weights, tokenizer)."""
    from kvconvert.checkpoint.gguf_import import import_gguf  # refuses an existing --out before loading

    opts = build_options(ImportOptions, params)
    click.echo(str(import_gguf(gguf_file, out_dir, dtype=opts.dtype, overwrite=overwrite)))
