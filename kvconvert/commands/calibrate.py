"""`kvconvert calibrate` command line (click). The work is in kvconvert.quant.run."""

from __future__ import annotations

import click

from kvconvert.commands.options import click_options, out_option, overwrite_option, threads_option
from kvconvert.quant.options import CalibrateOptions
from kvconvert.stage_options import build_options


@click.command("calibrate")
@click.option("--src", required=True, help="Model folder, built-in name (smollm2-135m) or hub id.")
@click_options(CalibrateOptions)
@out_option("Output folder (written atomically).", required=False)
@click.option("--in-place", is_flag=True, help="Replace --src itself (built beside it, swapped in at the end).")
@overwrite_option
@threads_option
@click.option("--quiet", is_flag=True, help="No progress output.")
def calibrate_cmd(src, out, in_place, overwrite, threads, quiet, **params):
    """Calibrate static FP8 / INT8 / NVFP4 KV-cache scales, fold them into the weights and write them in vLLM
    and/or ModelOpt names; for llama.cpp's cache types (q8_0, q4_0, iq4_nl, ...), fold the weight rewrites that
    suit its rotated block quantizer (kvconvert export-gguf then writes the file llama.cpp loads)."""
    from kvconvert.checkpoint import check_not_source
    from kvconvert.quant.run import CalibrateJob, run_calibrate
    from kvconvert.sources import resolve_source

    if out is not None:  # before any work, --overwrite or not (--in-place is the way to rewrite the source)
        check_not_source(out, (resolve_source(src),), hint=", or pass --in-place to rewrite the source on purpose")
    job = CalibrateJob(src=src, options=build_options(CalibrateOptions, params), out=out, in_place=in_place,
                       overwrite=overwrite, threads=threads)
    echo = (lambda msg: None) if quiet else (lambda msg: click.echo(msg, err=True))
    result = run_calibrate(job, echo=echo)
    names = f"{', '.join(result['formats'])} names" if result["formats"] else "no scales: llama.cpp sets them per block"
    click.echo(f"wrote {result['path']} ({names}; {result['tokens']} tokens in {result['time_s']:.1f} s)")
