"""`kvconvert budget`: the KV-cache capacity planner (kvconvert.budget), as text or JSON. Never imports torch."""

from __future__ import annotations

import json

import click

from kvconvert import kvmath
from kvconvert.budget import budget_report
from kvconvert.errors import KVConvertError
from kvconvert.kvformat import KV_FORMATS
from kvconvert.model_info import load_model_info
from kvconvert.presets import PRESETS


def human_budget(r: dict) -> str:
    f = kvmath.format_bytes
    lines = [f"model        {r['model']} ({r['origin']}), {r['attention_kind']} attention",
             f"KV dtype     {r['kv_dtype']} ({r['bytes_per_value']:g} bytes/value)"]
    if "mla_whatif" in r:
        w = r["mla_whatif"]
        lines.append(f"MLA what-if  kv_lora_rank {w['kv_lora_rank']} + rope {w['qk_rope_head_dim']}: "
                     f"{r['original_bytes_per_token']:,} ({r['original_kv_dtype']}) -> {r['bytes_per_token']:,} bytes/token "
                     f"({r['original_bytes_per_token'] / r['bytes_per_token']:.2f}x smaller)")
    lines += [f"per token    {r['bytes_per_token']:,} bytes ({f(r['bytes_per_token'])})",
              f"per request  {r['context']:,} tokens: {r['bytes_per_request']:,} bytes ({f(r['bytes_per_request'])})",
              f"total        batch {r['batch']}: {r['bytes_total']:,} bytes ({f(r['bytes_total'])})"]
    if "requests_fit" in r:
        lines += [f"weights      {r['parameters']:,} params in {r['weights_dtype']}: {f(r['weights_bytes'])}",
                  f"GPU memory   {f(r['gpu_mem_bytes'])}: {f(r['kv_budget_bytes'])} left for the KV cache",
                  f"fits         {r['requests_fit']} concurrent requests of {r['context']:,} tokens"
                  f" (batch {r['batch']}: {'yes' if r['batch_fits'] else 'no'})"]
    lines += [f"note         {n}" for n in r["notes"]]
    return "\n".join(lines)


@click.command("budget")
@click.option("--model", "model", required=True, help=f"Preset ({', '.join(PRESETS)}), HF folder or config.json.")
@click.option("--context", type=int, default=None, help="Tokens per request [default: max_position_embeddings].")
@click.option("--batch", type=int, default=1, show_default=True, help="Concurrent requests.")
@click.option("--kv-dtype", default="bf16", show_default=True,
              type=click.Choice(list(KV_FORMATS), case_sensitive=False), help="KV-cache format.")
@click.option("--mla-rank", type=int, default=None, help="What-if: convert to MLA with this kv_lora_rank.")
@click.option("--rope-dim", type=int, default=None, help="What-if: shared RoPE key dims [default with --mla-rank: 64].")
@click.option("--gpu-mem", default=None, help="GPU memory, e.g. 80GiB or 141GB: how many requests fit beside the weights.")
@click.option("--weights-dtype", default="bf16", show_default=True,
              type=click.Choice(list(KV_FORMATS), case_sensitive=False), help="Weight format for --gpu-mem.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of text.")
def budget_cmd(model, context, batch, kv_dtype, mla_rank, rope_dim, gpu_mem, weights_dtype, as_json):
    """KV-cache memory for a model, context and batch; optionally an MLA what-if and a GPU fit."""
    if rope_dim is not None and mla_rank is None:
        raise KVConvertError("--rope-dim needs --mla-rank (the what-if MLA latent size)")
    if mla_rank is not None and rope_dim is None:
        rope_dim = 64  # DeepSeek-V2/V3's qk_rope_head_dim
    info = load_model_info(model, prefer_preset=True)
    report = budget_report(info, context, batch, kv_dtype, mla_rank, rope_dim, gpu_mem, weights_dtype)
    click.echo(json.dumps(report, indent=2) if as_json else human_budget(report))
