"""`kvconvert inspect`: what a model is (kvconvert.model_info), as text or JSON."""

from __future__ import annotations

import json

import click

from kvconvert import kvmath
from kvconvert.model_info import inspect_report, load_model_info


def human_inspect(r: dict) -> str:
    lines = [f"model         {r['name']}" + (f"  ({r['path']})" if r["path"] else f"  ({r['origin']})"),
             f"architecture  {r['architecture']} (model_type {r['model_type']})"]
    if r["attention_kind"] == kvmath.MLA:
        lines.append(f"attention     MLA: {r['num_hidden_layers']} layers, {r['num_attention_heads']} heads, "
                     f"kv_lora_rank {r['kv_lora_rank']}, qk_rope_head_dim {r['qk_rope_head_dim']}")
    elif r["attention_kind"]:
        lines.append(f"attention     {r['attention_kind']}: {r['num_hidden_layers']} layers, "
                     f"{r['num_attention_heads']} heads, {r['num_key_value_heads'] or r['num_attention_heads']} KV heads, "
                     f"head_dim {r['head_dim']}")
    if r["parameters"] is not None:
        disk = f"; {kvmath.format_bytes(r['weights_bytes'])} on disk" if r["weights_bytes"] else ""
        dtypes = f", {'/'.join(sorted(r['tensor_dtypes']))}" if r["tensor_dtypes"] else ""
        lines.append(f"parameters    {r['parameters']:,} (from {r['parameters_source']}{dtypes}{disk})")
    if r["kv_bytes_per_token"]:
        per = ", ".join(f"{d} {b:,} B" for d, b in r["kv_bytes_per_token"].items())
        lines.append(f"KV per token  {per}  ({r['kv_values_per_token_per_layer']} values/layer; "
                     "nvfp4 includes its E4M3 block scales)")
    if r.get("llamacpp_kv_bytes_per_token"):
        per = ", ".join(f"{d} {b:,} B" for d, b in r["llamacpp_kv_bytes_per_token"].items())
        lines.append(f"llama.cpp     {per}  (-ctk/-ctv: keys and values apart; block scales included)")
    lines += [f"note          {n}" for n in r["notes"]]
    return "\n".join(lines)


@click.command("inspect")
@click.argument("src")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of text.")
def inspect_cmd(src, as_json):
    """Describe a model: architecture, attention kind, heads, parameters, KV bytes per token.

    SRC: a Hugging Face folder, a config.json, a built-in model (smollm2-135m), a preset
    (see `kvconvert budget --help`) or a hub id. Reads headers only, never the weights.
    """
    report = inspect_report(load_model_info(src, prefer_preset=False))
    click.echo(json.dumps(report, indent=2) if as_json else human_inspect(report))
