"""`kvconvert budget`: the KV-cache capacity planner (kvconvert.budget), as text or JSON. Never imports torch."""

from __future__ import annotations

import json

import click

from kvconvert import kvmath
from kvconvert.budget import BudgetOptions, budget_report
from kvconvert.commands.options import click_options
from kvconvert.model_info import load_model_info
from kvconvert.presets import PRESETS
from kvconvert.stage_options import build_options


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
@click_options(BudgetOptions)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of text.")
def budget_cmd(model, as_json, **params):
    """KV-cache memory for a model, context and batch; optionally an MLA what-if and a GPU fit."""
    opts = build_options(BudgetOptions, params)
    report = budget_report(load_model_info(model, prefer_preset=True), opts)
    click.echo(json.dumps(report, indent=2) if as_json else human_budget(report))
