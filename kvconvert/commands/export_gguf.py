"""`kvconvert export-gguf`: a Llama-family source or a kvconvert MLA conversion as a GGUF file for stock
llama.cpp (kvconvert.checkpoint.gguf_export)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvconvert.commands.options import click_options
from kvconvert.engines.gguf_options import GGUFExportOptions
from kvconvert.stage_options import build_options


@click.command("export-gguf")
@click.option("--src", required=True, help="Model: local HF folder, built-in name (smollm2-135m) or hub id; a "
                                           "Llama-family source or a `kvconvert mla` output.")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The .gguf file to write.")
@click_options(GGUFExportOptions)
@click.option("--overwrite", is_flag=True, help="Replace an existing --out file.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def export_gguf_cmd(src, out, overwrite, as_json, **params):
    """Write a checkpoint as GGUF for stock llama.cpp: Llama sources as LLAMA, MLA conversions as DEEPSEEK2
    (the latent in llama.cpp's K cache), the tokenizer included."""
    from kvconvert.checkpoint import CheckpointReader, check_checkpoint, read_config
    from kvconvert.checkpoint.gguf_export import check_no_kv_scales, check_output_file, export_gguf, gguf_arch
    from kvconvert.sources import resolve_source
    from kvconvert.targets import llamacpp_config_problem

    opts = build_options(GGUFExportOptions, params)
    src_path = resolve_source(src)
    check_output_file(out, overwrite, sources=(src_path,))  # before the checkpoint's full read
    gguf_arch(read_config(src_path))  # an architecture the export does not write: refused before that read
    with CheckpointReader(src_path) as reader:
        check_no_kv_scales(reader)  # a calibrated checkpoint: the source to export instead, before that read too
    check_checkpoint(src_path)
    summary = export_gguf(src_path, out, opts, overwrite=overwrite, name=str(src)).as_dict()
    problem = llamacpp_config_problem(read_config(src_path))  # the one rule calibrate, validate and plan ask
    notes = [*summary.get("notes", []), *([f"llama.cpp serves this model with a float cache only (-ctk / -ctv f32, "
                                            f"f16, bf16): {problem}"] if problem else [])]
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    width = max(len(k) for k in summary)
    click.echo("\n".join(["GGUF written:"] + [f"{k:<{width}}  {v}" for k, v in summary.items()]))
