"""The KV-cache capacity planner behind `kvconvert budget` (kvconvert.commands.budget): bytes per
token / request / batch, an MLA what-if, and how many requests fit beside the weights on a GPU.
Reads config.json and safetensors headers only (kvconvert.model_info); never imports torch."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from kvconvert import kvmath
from kvconvert.errors import KVConvertError
from kvconvert.kvformat import KV_FORMATS, kv_dtype_type, kv_format, kv_pair, pair_help
from kvconvert.model_info import ModelInfo
from kvconvert.stage_options import StageOptions


DEEPSEEK_ROPE_DIM = 64  # DeepSeek-V2/V3's qk_rope_head_dim: the what-if's RoPE part unless --rope-dim says


class BudgetOptions(StageOptions):
    """What `kvconvert budget` computes for a model (its flags, kvconvert.commands.budget)."""

    context: int | None = Field(None, description="Tokens per request [default: max_position_embeddings].")
    batch: int = Field(1, description="Concurrent requests.")  # checked below, with the message that names it
    kv_dtype: kv_dtype_type(tuple(KV_FORMATS)) = Field("bf16", description="KV-cache format. " + pair_help(
        tuple(KV_FORMATS)) + " Bytes: K's in its format plus V's in its own.")
    mla_rank: int | None = Field(None, description="What-if: convert to MLA with this kv_lora_rank.")
    rope_dim: int | None = Field(None, description="What-if: shared RoPE key dims [default with --mla-rank: "
                                                   f"{DEEPSEEK_ROPE_DIM}].")
    gpu_mem: str | None = Field(None, description="GPU memory, e.g. 80GiB or 141GB: how many requests fit beside "
                                                  "the weights.")
    weights_dtype: Literal[tuple(KV_FORMATS)] = Field("bf16", description="Weight format for --gpu-mem.")

    @model_validator(mode="after")
    def _rope_needs_rank(self):
        if self.rope_dim is not None and self.mla_rank is None:
            raise ValueError("--rope-dim needs --mla-rank (the what-if MLA latent size)")
        return self


def budget_report(info: ModelInfo, opts: BudgetOptions) -> dict:
    """KV bytes per token / request / batch and, with gpu_mem, how many requests fit."""
    context, batch, mla_rank, gpu_mem = opts.context, opts.batch, opts.mla_rank, opts.gpu_mem
    rope_dim = DEEPSEEK_ROPE_DIM if opts.rope_dim is None else opts.rope_dim
    fmt, config = kv_pair(opts.kv_dtype), info.config  # a format, or K and V apart (q5_0/iq4_nl)
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
        fmt.check_cache_kind(is_mla=True)  # a K/V pair: the MLA row has no V half
        original = kv_pair("bf16") if fmt.k.mla_only else fmt  # an MLA-only format: against today's bf16 cache
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
        report.update(_fit(info, report, gpu_mem, opts.weights_dtype, notes))
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
