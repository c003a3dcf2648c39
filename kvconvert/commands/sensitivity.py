"""`kvconvert sensitivity`: where a llama.cpp cache's loss sits, K or V, layer by layer (kvconvert.quant.sensitivity)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvconvert.commands.options import click_options
from kvconvert.quant.sensitivity import SensitivityOptions
from kvconvert.stage_options import build_options


@click.command("sensitivity")
@click.option("--src", "src", default="smollm2-135m", show_default=True, help="Model: a built-in name or HF folder.")
@click_options(SensitivityOptions)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the report as JSON here.")
def sensitivity_cmd(src, json_out, **params):
    """KL of K-only and V-only rounding in a llama.cpp cache type (or K/V pair), all layers and per layer."""
    from kvconvert.quant.sensitivity import cache_sensitivity, markdown

    opts = build_options(SensitivityOptions, params)
    report = cache_sensitivity(src, opts, echo=lambda msg: click.echo(msg, err=True))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(markdown(report))
