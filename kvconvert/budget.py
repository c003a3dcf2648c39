"""`kvconvert budget`: the KV-cache capacity planner: bytes per token / request / batch, an MLA
what-if, and how many requests fit beside the weights on a GPU. Reads config.json and safetensors
headers only (kvconvert.model_info); never imports torch."""

from __future__ import annotations

import json
import math

import click

from kvconvert import kvmath
from kvconvert.errors import KVConvertError
from kvconvert.kvformat import KV_FORMATS, kv_format
from kvconvert.model_info import ModelInfo, load_model_info
from kvconvert.presets import PRESETS


def budget_report(info: ModelInfo, context: int | None, batch: int, kv_dtype: str, mla_rank: int | None,
                  rope_dim: int | None, gpu_mem: str | None, weights_dtype: str) -> dict:
    """KV bytes per token / request / batch and, with gpu_mem, how many requests fit."""
    fmt, config = kv_format(kv_dtype), info.config
    shape = kvmath.kv_shape(config)
    if context is None:
        context = kvmath.text_config(config).get("max_position_embeddings")
        if not context:
            raise KVConvertError("the config has no max_position_embeddings; pass --context N")
    if batch <= 0:
        raise KVConvertError(f"--batch must be positive, got {batch}")
    report = {"model": info.name, "origin": info.origin, "attention_kind": shape.kind, "kv_dtype": fmt.name,
              "bytes_per_value": fmt.bytes_per_value, "context": context, "batch": batch}
    windows = kvmath.layer_windows(config)
    if mla_rank is not None:
        original = kv_format("bf16") if fmt.mla_only else fmt  # an MLA-only format: against today's bf16 cache
        report["original_kv_dtype"] = original.name
        report["original_bytes_per_token"] = kvmath.kv_bytes_per_token(shape, original)
        shape, windows = kvmath.mla_whatif(shape, mla_rank, rope_dim), [None] * shape.num_layers
        report["mla_whatif"] = {"kv_lora_rank": mla_rank, "qk_rope_head_dim": rope_dim}
    report["values_per_token_per_layer"] = shape.values_per_token_per_layer
    report["bytes_per_token"] = kvmath.kv_bytes_per_token(shape, fmt)
    report["bytes_per_request"] = kvmath.kv_bytes_per_request(shape, fmt, context, windows)
    report["bytes_total"] = report["bytes_per_request"] * batch
    notes = list(info.notes)
    if any(w is not None for w in windows):
        notes.append("sliding-window layers keep at most their window of tokens")
    if fmt.name == "nvfp4":
        naive = report["bytes_per_request"] * 0.5 / fmt.bytes_per_value
        notes.append("nvfp4 counts its block scales: 0.5625 bytes/value (4-bit values + one E4M3 scale per 16 "
                     "values; the fp32 global scale is negligible). The commonly quoted 0.5 byte/value ignores "
                     f"the block scales and would say {kvmath.format_bytes(naive)} per request.")
    if fmt.name == "int4":
        notes.append("int4 counted as symmetric 4-bit values + one fp16 scale per group of 32 (0.5625 bytes/value)")
    if gpu_mem is not None:
        report.update(_fit(info, report, gpu_mem, weights_dtype, notes))
    report["notes"] = notes
    return report


def _fit(info: ModelInfo, report: dict, gpu_mem: str, weights_dtype: str, notes: list[str]) -> dict:
    if info.parameters is None:
        raise KVConvertError(f"{info.name}: parameter count unknown (no weights, config not countable); "
                             "cannot place the weights on --gpu-mem")
    wfmt = kv_format(weights_dtype)
    gpu_bytes = kvmath.parse_size(gpu_mem)
    weights_bytes = math.ceil(info.parameters * wfmt.bytes_per_value)
    free = gpu_bytes - weights_bytes
    notes.append("activations, CUDA graphs and allocator overhead are not counted: leave headroom")
    return {"gpu_mem_bytes": gpu_bytes, "weights_dtype": wfmt.name, "parameters": info.parameters,
            "weights_bytes": weights_bytes, "kv_budget_bytes": max(free, 0),
            "requests_fit": max(free, 0) // report["bytes_per_request"],
            "batch_fits": free >= report["bytes_total"]}


def _human_budget(r: dict) -> str:
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
    click.echo(json.dumps(report, indent=2) if as_json else _human_budget(report))
