"""`kvconvert calibrate` command line (click). The work is in kvconvert.quant.run."""

from __future__ import annotations

import click

from kvconvert.quant.options import FORMATS, GRANULARITIES, KV_DTYPES, OBSERVERS


@click.command("calibrate")
@click.option("--src", required=True, help="Model folder, built-in name (smollm2-135m) or hub id.")
@click.option("--kv-dtype", required=True, help=f"KV cache format: {', '.join(KV_DTYPES)}.")
@click.option("--observer", default="mse", show_default=True,
              help=f"Scale statistic: {', '.join(OBSERVERS)} (mse = attention-output error search).")
@click.option("--granularity", default="tensor", show_default=True, help=f"{' or '.join(GRANULARITIES)} (per KV head).")
@click.option("--percentile", default=99.99, show_default=True, type=float, help="Percentile for --observer percentile.")
@click.option("--calib-data", default="builtin", show_default=True, help="builtin (pydoc), essays, a .txt/.jsonl/.parquet file, or a datasets id.")
@click.option("--calib-tokens", default=16384, show_default=True, type=int, help="Calibration tokens (windows of --window-len).")
@click.option("--window-len", default=512, show_default=True, type=int, help="Tokens per calibration window.")
@click.option("--format", "fmt", default="auto", show_default=True,
              help=f"Export names: {', '.join(FORMATS)} (auto: fp8 -> both, nvfp4 -> modelopt, per-head/e5m2 -> vllm).")
@click.option("--rotate/--no-rotate", default=None,
              help="Fold exact rewrites into the weights (outputs unchanged in full precision, free at "
                   "serving): per-RoPE-pair q/k phases that cut the keys' rounding noise (fp8, nvfp4), and a "
                   "Hadamard rotation of V / the MLA latent (nvfp4). Default: on.")
@click.option("--key-phase/--no-key-phase", default=True, show_default=True,
              help="With --rotate: fold the per-RoPE-pair q/k phases (--no-key-phase leaves q_proj/k_proj as they are).")
@click.option("--value-rotation/--no-value-rotation", default=None,
              help="With --rotate: Hadamard on V / the MLA latent (default: on for nvfp4 only).")
@click.option("--rotation-block", default=0, show_default=True, type=click.IntRange(min=0),
              help="Hadamard block of the value rotation (0 = largest power of two dividing the dim, capped at 128).")
@click.option("--key-strength", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="RoPE-pair amax equalization of the keys, 0..1 (0 = off: measured worse for nvfp4).")
@click.option("--out", type=click.Path(), default=None, help="Output folder (written atomically).")
@click.option("--in-place", is_flag=True, help="Rewrite only the changed files of --src (atomic per file, no backup).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out folder.")
@click.option("--search-tokens", default=1024, show_default=True, type=int,
              help="Calibration tokens replayed by the mse scale search (the first windows).")
@click.option("--batch-size", default=4, show_default=True, type=int, help="Windows per forward pass.")
@click.option("--threads", default=None, type=int, help="torch CPU threads (default: torch's choice).")
@click.option("--quiet", is_flag=True, help="No progress output.")
def calibrate_cmd(src, kv_dtype, observer, granularity, percentile, calib_data, calib_tokens, window_len, fmt,
                  rotate, key_phase, value_rotation, rotation_block, key_strength, out, in_place, overwrite, search_tokens,
                  batch_size, threads, quiet):
    """Calibrate static FP8 / NVFP4 KV-cache scales and write them in vLLM and/or ModelOpt names."""
    from kvconvert.quant.run import CalibrateJob, run_calibrate

    job = CalibrateJob(src=src, kv_dtype=kv_dtype, observer=observer, granularity=granularity,
                       percentile=percentile, calib_data=calib_data, calib_tokens=calib_tokens,
                       window_len=window_len, fmt=fmt, rotate=rotate, key_phase=key_phase,
                       value_rotation=value_rotation, rotation_block=rotation_block, key_strength=key_strength, out=out, in_place=in_place,
                       overwrite=overwrite, search_tokens=search_tokens, batch_size=batch_size,
                       threads=threads)
    echo = (lambda msg: None) if quiet else (lambda msg: click.echo(msg, err=True))
    result = run_calibrate(job, echo=echo)
    click.echo(f"wrote {result['path']} ({', '.join(result['formats'])} names; "
               f"{result['tokens']} tokens in {result['time_s']:.1f} s)")
