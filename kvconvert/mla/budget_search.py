"""Pick rank and rope-dim for a KV budget from measured errors.

DeepSeek-V3 needs one (kv_lora_rank, qk_rope_head_dim) for all layers, and the split of a fixed
budget between RoPE dims and latent dims decides much of the quality. For each valid rope-dim we
convert a few probe layers (spread over depth) in closed form at rank = budget - rope_dim and
measure the attention-output error on calibration data; the split with the lowest mean error wins.
"""

from __future__ import annotations

from pathlib import Path


from kvconvert import kvmath
from kvconvert.checkpoint import CheckpointReader
from kvconvert.data import calibration_windows
from kvconvert.device import resolve_device
from kvconvert.errors import KVConvertError
from kvconvert.mla import deepseek_format as fmt
from kvconvert.mla.convert_layer import LayerPlan, convert_layer, max_rank
from kvconvert.mla.options import DEFAULT_CONVERT_TEXT
from kvconvert.targets import get_target, rope_dims_for, servable_shapes


def candidate_splits(cfg: dict, budget: int, target: str = "any") -> list[tuple[int, int]]:
    """(rank, rope_dim) pairs to try for a budget of KV values per token and layer. For a research
    target (and an engine that takes any latent size, like llama.cpp): rank + rope_dim == budget, rope_dim a
    valid fold of head_dim (>= 8) that the target serves. For an engine with fixed latent sizes: the shapes it
    serves at its largest latent size within the budget (kvconvert.targets)."""
    d = kvmath.head_dim(cfg)
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    engine = get_target(target)
    if engine.latent_sizes is not None:
        return _servable_within(engine, budget, kv_heads, d)
    out = [(budget - rope, rope) for rope in rope_dims_for(d)
           if rope >= 8 and 1 <= budget - rope <= max_rank(kv_heads, d, rope) and engine.serves(budget - rope, rope)]
    if not out:
        blocks = f"; {engine.name}: {engine.note}" if engine.multiple_of else ""
        raise KVConvertError(f"--kv-budget {budget}: no valid rank + rope-dim split (rope-dim must fold head_dim {d}"
                             f"{blocks})")
    return out


def _servable_within(engine, budget: int, kv_heads: int, d: int) -> list[tuple[int, int]]:
    shapes = [s for s in servable_shapes(engine, kv_heads, d) if sum(s) <= budget]
    if not shapes:
        full = 2 * kv_heads * d
        sizes = ", ".join(f"{n} ({100 * n / full:.0f}%)" for n in sorted(engine.latent_sizes) if n < full) or "none"
        raise KVConvertError(
            f"--kv-budget {budget} values per token and layer: {engine.name} serves MLA latents of "
            f"{', '.join(map(str, sorted(engine.latent_sizes)))} values only ({engine.note}); for this model "
            f"(K+V = {full} values) that means: {sizes}. Raise the budget, quantize the source's KV cache instead "
            "(kvconvert calibrate), or pass --target any for a research shape.")
    best = max(sum(s) for s in shapes)
    return [s for s in shapes if sum(s) == best]


def parse_budget(text: str, cfg: dict) -> int:
    """'0.25' / '25%' of the source's K+V values per token per layer, or an absolute count like '96'."""
    d = kvmath.head_dim(cfg)
    full = 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * d
    text = text.strip()
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise KVConvertError(f"--kv-budget {text!r}: give a fraction (0.25), a percentage (25%) or a value count (96)") from None
    budget = round(value * full) if value <= 1 else int(value)
    if not 8 < budget <= full:
        raise KVConvertError(f"--kv-budget {text}: must be between 9 and {full} values per token per layer")
    return budget


def search_split(src_path: Path, budget: int, calib_data: str = DEFAULT_CONVERT_TEXT, calib_tokens: int = 2048,
                 probes: int = 3, key_weight: float = 0.3, progress: bool = True,
                 target: str = "any", device: str = "auto") -> tuple[int, int, list[dict]]:
    """(rank, rope_dim, table) minimising the mean o_proj-refitted attention error on probe layers
    among the splits the target engine serves (a single servable split is returned unmeasured).
    device: where the probe layers' closed forms run (kvconvert.device)."""
    reader = CheckpointReader(src_path)
    cfg = reader.config
    fmt.check_source_config(cfg)
    splits = candidate_splits(cfg, budget, target)
    if len(splits) == 1:
        (rank, rope), = splits
        if progress:
            print(f"kv budget {budget}: {target} serves one split here: rank {rank} + rope {rope}")
        return rank, rope, [dict(rank=rank, rope_dim=rope, mean_attn_error=None)]
    return _measure_splits(reader, cfg, splits, budget, calib_data, calib_tokens, probes, key_weight, progress,
                           resolve_device(device))


def _measure_splits(reader, cfg, splits, budget, calib_data, calib_tokens, probes, key_weight, progress, device):
    from transformers import AutoTokenizer

    from kvconvert.mla.convert import source_layer_weights
    from kvconvert.models import llama
    from kvconvert.models.common import DecoderLayer, rms_norm
    from kvconvert.models.deepseek_v3 import MLAShape

    d, source = kvmath.head_dim(cfg), llama.LlamaShape.from_config(cfg)
    layers = cfg["num_hidden_layers"]
    probe_layers = sorted({round((k + 0.5) * layers / probes) for k in range(probes)} - {layers})
    tok = AutoTokenizer.from_pretrained(str(reader.path))
    ids = calibration_windows(tok, calib_data, calib_tokens, 256)
    hidden = reader.get("model.embed_tokens.weight")[ids].float().to(device)
    errors = {s: [] for s in splits}
    for i in range(max(probe_layers) + 1):
        w = {k: v.to(device) for part in ("attention", "mlp") for k, v in source_layer_weights(reader, i, part).items()}
        if i in probe_layers:
            xn = rms_norm(hidden, w["input_layernorm"], source.rms_eps)
            for rank, rope in splits:
                plan = LayerPlan.for_source(d, rank, rope, key_weight=key_weight)
                target_cfg = fmt.deepseek_config(cfg, rank, rope, plan.nope_dim, plan.v_dim, None, "float32")
                result = convert_layer(xn, w, source, MLAShape.from_config(target_cfg), plan, layer=i)
                errors[(rank, rope)].append(result.report["attn_rel_error_refit"])
        hidden = llama.layer(hidden, DecoderLayer.of(w, llama.LlamaAttention), source)
    table = [dict(rank=r, rope_dim=p, mean_attn_error=sum(e) / len(e)) for (r, p), e in errors.items()]
    best = min(table, key=lambda row: row["mean_attn_error"])
    if progress:
        for row in table:
            mark = "  <- chosen" if row is best else ""
            print(f"kv budget {budget}: rank {row['rank']:4d} + rope {row['rope_dim']:3d}: "
                  f"attention error {row['mean_attn_error']:.4f}{mark}")
    return best["rank"], best["rope_dim"], table
