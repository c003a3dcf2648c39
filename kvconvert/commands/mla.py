"""`kvconvert mla`: MHA/GQA -> stock DeepSeek-V3 MLA (kvconvert.mla.convert, healed by the pipeline's
convert_stage when --heal is given)."""

from __future__ import annotations

from pathlib import Path

import click

from kvconvert.commands.options import click_options, overwrite_option
from kvconvert.errors import KVConvertError
from kvconvert.mla.options import MLAOptions
from kvconvert.stage_options import build_options


@click.command("mla")
@click.option("--src", required=True, help="Source model: local HF folder, built-in name (smollm2-135m) or hub id.")
@click.option("--kv-budget", default=None,
              help="Instead of --rank/--rope-dim: KV values kept per token and layer, as a fraction of the "
                   "source's K+V (0.25, 25%) or a count (96); the split is chosen among the shapes --target serves.")
@click_options(MLAOptions)
@click.option("--heal", default="none", show_default=True,
              help="none, a heal preset (layerwise, layerwise+distill) or a recipe YAML (its heal blocks).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True)
@overwrite_option
@click.option("--json", "as_json", is_flag=True, help="Print the conversion summary as JSON.")
def mla_cmd(src, kv_budget, heal, out_dir, overwrite, as_json, **params):
    """Convert a Llama-family (MHA/GQA) checkpoint to Multi-head Latent Attention in stock DeepSeek-V3
    format (loads in transformers, vLLM and SGLang with no custom code)."""
    import json

    from kvconvert.checkpoint import check_checkpoint, check_output_path
    from kvconvert.pipeline import convert_stage, heal_recipe  # the heal chain lives at the pipeline level
    from kvconvert.sources import resolve_source

    src_path = resolve_source(src)
    check_output_path(out_dir, overwrite, sources=(src_path,))  # never the source, even with --overwrite
    recipe = heal_recipe(heal)
    check_checkpoint(src_path)  # config features, missing tensors, NaN/inf: before any conversion work
    if (params["rank"] is None) == (kv_budget is None):
        raise KVConvertError("give exactly one of --rank or --kv-budget")
    if kv_budget is not None:
        if params["rope_dim"] is not None:
            raise KVConvertError("--kv-budget chooses --rope-dim itself; drop --rope-dim (or use --rank)")
        from kvconvert.checkpoint import read_config
        from kvconvert.mla.budget_search import parse_budget, search_split

        probe = build_options(MLAOptions, params, rank=1)  # checks the other options before the search
        budget = parse_budget(kv_budget, read_config(src_path))
        params["rank"], params["rope_dim"], _ = search_split(src_path, budget, probe.calib_data,
                                                             key_weight=probe.key_weight, target=probe.target)
    opts = build_options(MLAOptions, params)
    report = convert_stage(src_path, opts, out_dir, recipe, source_name=str(src), overwrite=overwrite)
    summary = _summary(report, out_dir)
    click.echo(json.dumps(summary, indent=2) if as_json else _table(summary))


def _summary(report, out_dir: Path) -> dict:
    cfg, layers = report.config, report.layers
    return {
        "out": str(out_dir),
        "kv_lora_rank": cfg["kv_lora_rank"],
        "qk_rope_head_dim": cfg["qk_rope_head_dim"],
        "kv_values_per_token_per_layer": cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],
        "mean_rope_energy_kept": sum(r["rope_energy_kept"] for r in layers) / len(layers),
        "mean_latent_energy_kept": sum(r["latent_energy_kept"] for r in layers) / len(layers),
        "mean_attn_rel_error": sum(r.get("attn_rel_error_refit", r["attn_rel_error"]) for r in layers) / len(layers),
        "seconds": round(report.seconds, 1),
        "peak_rss_mb": round(report.peak_rss_mb),
        "calib_tokens": report.calib_tokens,
    }


def _table(summary: dict) -> str:
    width = max(len(k) for k in summary)
    lines = [f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}" for k, v in summary.items()]
    return "\n".join(["MLA conversion written:"] + lines)
