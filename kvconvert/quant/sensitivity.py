"""Where a llama.cpp cache's loss sits (`kvconvert sensitivity`): the KL to the unrounded cache when only the keys,
only the values, or both are stored as llama.cpp stores them, over all layers and one layer at a time.

    report = cache_sensitivity("smollm2-135m", SensitivityOptions(kv_dtype="iq4_nl"))
    report["all"]  # {"k_only": ..., "v_only": ..., "both": ...}: mean KL per token, nats
    report["layers"][i]  # {"layer": i, "k_only": ..., "v_only": ...}: that layer's half alone rounded

The rounding is the engine's, bit-exact (kvconvert.ggml_formats' frames, as kvconvert.quant.hooks.llamacpp_hook
applies them: K in llama.cpp's pair order and Hadamard, V in its 64-wide Hadamard, blocks of 32 with fp16
scales), in transformers with fp32 weights, on held-out essay windows; the reference is the same model with its
cache unrounded. A pair (q5_0/iq4_nl) rounds K in its K type and V in its V type. K-only and V-only KL need not
add up to both (the errors interact through the softmax), and per-layer KL need not add up to all layers.
MLA has no K/V halves (one row in llama.cpp's K cache): refused; per-head K/V models only.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import kv_dtype_type, kv_pair, ggml_type_names
from kvconvert.stage_options import StageOptions

SIDES = {"k_only": ("k",), "v_only": ("v",), "both": ("k", "v")}


class SensitivityOptions(StageOptions):
    """What `kvconvert sensitivity` rounds and on how much text."""

    kv_dtype: kv_dtype_type(ggml_type_names()) = Field(
        "iq4_nl", description="llama.cpp cache type, or a K/V pair KTYPE/VTYPE (q5_0/iq4_nl): K-only rounds in the "
                              "K type, V-only in the V type.")
    windows: int = Field(4, ge=1, description="Held-out essay windows scored.")
    window_len: int = Field(512, ge=16, description="Tokens per window.")
    per_layer: bool = Field(True, description="Also each layer's K alone and V alone (2 x layers more forwards).")


def cache_sensitivity(src: str | Path, opts: SensitivityOptions, echo=lambda msg: None, dtype=None,
                      device: str = "cpu") -> dict:
    """The KL of K-only, V-only and both roundings, over all layers and (per_layer) one layer at a time; the model
    in `dtype` weights (a torch dtype; None: fp32) on `device`."""
    import torch

    from kvconvert.checkpoint import CheckpointReader, load_tokenizer
    from kvconvert.data import eval_windows
    from kvconvert.ggml_formats import llamacpp_frames, rotation_enabled
    from kvconvert.quant.capture import cache_hook, forward_with_hook, load_hf_model
    from kvconvert.quant.layout import detect_kv_layout
    from kvconvert.sources import resolve_source
    from kvconvert.targets import check_llamacpp_shape

    path = resolve_source(src)
    pair = kv_pair(opts.kv_dtype)
    with CheckpointReader(path, verify=False) as reader:
        layout = detect_kv_layout(reader.config, reader.keys())
    if layout.is_mla:
        raise KVConvertError("sensitivity rounds K and V apart; an MLA model caches one row [latent | k_rope] in "
                             "llama.cpp's K cache, with no V half: validate it with --kv-dtype instead")
    check_llamacpp_shape(pair.name, False, head_dim=layout.head_dim)
    frames = llamacpp_frames(*pair.ggml_types, layout.row_dim, mla=False)
    windows = eval_windows(load_tokenizer(path), opts.windows, opts.window_len)
    model = load_hf_model(path, dtype or torch.float32).to(device)
    windows = windows.to(device)
    with torch.no_grad():
        reference = [model(w[None]).logits[0] for w in windows]

    def kl(rounded) -> float:
        """Mean KL per token (nats) with the cached quantities `rounded(layer, kind)` stored as llama.cpp does."""
        from kvconvert.token_stats import TokenSums, window_sums

        hook = cache_hook(layout, lambda layer, kind, x: frames[kind].fake_quant(x) if rounded(layer, kind) else x)
        total = TokenSums()
        for ids, ref in zip(windows, reference):
            total += window_sums(forward_with_hook(model, ids[None], hook)[0], ids, ref)
        return total.kl / total.tokens

    report = {"kv_dtype": pair.name, "k_type": pair.k.name, "v_type": pair.v.name, "rotation": rotation_enabled(),
              "windows": len(windows), "window_len": opts.window_len, "tokens": len(windows) * (opts.window_len - 1)}
    report["all"] = {name: kl(lambda layer, kind, s=sides: kind in s) for name, sides in SIDES.items()}
    echo(f"{pair.name}: all layers K-only {report['all']['k_only']:.5f}, V-only {report['all']['v_only']:.5f}, "
         f"both {report['all']['both']:.5f}")
    if opts.per_layer:
        report["layers"] = []
        for i in range(layout.num_layers):
            row = {"layer": i, **{name: kl(lambda layer, kind, s=sides: layer == i and kind in s)
                                  for name, sides in SIDES.items() if name != "both"}}
            report["layers"].append(row)
            echo(f"  layer {i}: K-only {row['k_only']:.5f}, V-only {row['v_only']:.5f}")
    return report


def markdown(report: dict) -> str:
    """The report as a markdown table: all layers, then one row per layer."""
    a = report["all"]
    lines = [f"KV cache {report['kv_dtype']} (K {report['k_type']}, V {report['v_type']}; llama.cpp's rotation "
             f"{'on' if report['rotation'] else 'off'}), {report['windows']} x {report['window_len']} essay tokens: "
             "mean KL per token (nats) against the unrounded cache",
             "", "| rounded | K only | V only | both |", "|---|---:|---:|---:|",
             f"| all layers | {a['k_only']:.5f} | {a['v_only']:.5f} | {a['both']:.5f} |"]
    lines += [f"| layer {r['layer']} | {r['k_only']:.5f} | {r['v_only']:.5f} | - |" for r in report.get("layers", [])]
    return "\n".join(lines)
