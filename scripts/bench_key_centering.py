#!/usr/bin/env python
"""Can a checkpoint make its keys cheaper to store in llama.cpp's 4-bit caches by centring them?

A Llama's pre-RoPE keys carry a large mean (most of their energy). llama.cpp scales each block of 32 (after its
Hadamard) by its largest value, so a common offset spends the block's levels on what every key shares. Stock
Llama checkpoints may carry attention biases (config attention_bias, which transformers, vLLM and llama.cpp load),
so k_proj could subtract the mean. RoPE turns a pre-RoPE offset b into R(n) b: its score q_m . R(n - m) b depends
on the key's position unless the pair's frequency is so low that R barely turns over the context. So only the
slowest pairs can be centred almost exactly (theta x 4096 tokens <= 0.25 rad here); every other pair's mean is a
relative-position term the model uses.

Each row: the k_proj bias minus the key mean (8192 calibration tokens of the built-in pydoc text, positions 4+ of
each window) on the N slowest RoPE pairs of every head; KL(source || model) on held-out essays with the cache
unrounded (what the bias itself costs) and rounded as llama.cpp stores it (bit-exact frames, rotation on).

    python scripts/bench_key_centering.py --windows 6 --threads 2

Writes docs/bench_key_centering.json and prints a markdown table (same windows, one run).
"""

from __future__ import annotations

import torch
from bench_common import DOCS, bench_rows, command, parser, publish_rows, quant_eval_inputs, run_info, write_json

FORMATS = ("iq4_nl/iq4_nl", "q5_0/iq4_nl", "q4_0/q4_0")


def parse_args():
    ap = parser(__doc__)
    ap.add_argument("--src", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--pairs", default="0,3,4,5", help="slowest RoPE pairs centred per row (0: the source)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(DOCS / "bench_key_centering.json"))
    return ap.parse_args()


def key_means(model, windows: torch.Tensor, skip: int = 4) -> tuple[list[torch.Tensor], list[float]]:
    """Per layer, the mean k_proj output [kv_heads * head_dim] over `windows` (positions >= skip: the first tokens
    of a window are outliers that no bias should follow), and the share of the keys' energy the mean holds."""
    layers = model.model.layers
    width = layers[0].self_attn.k_proj.out_features
    sums, squares, count = [torch.zeros(width, dtype=torch.float64) for _ in layers], [0.0] * len(layers), [0]

    def observe(i):
        def hook(module, args, out):
            keys = out.detach()[0, skip:].double()
            sums[i] += keys.sum(0)
            squares[i] += float((keys ** 2).sum())
        return hook
    handles = [layer.self_attn.k_proj.register_forward_hook(observe(i)) for i, layer in enumerate(layers)]
    with torch.no_grad():
        for w in windows:
            model(w[None])
            count[0] += w.numel() - skip
    for h in handles:
        h.remove()
    means = [s / count[0] for s in sums]
    return means, [float((m ** 2).sum()) * count[0] / sq for m, sq in zip(means, squares)]


def slow_pair_mask(head_dim: int, kv_heads: int, pairs: int) -> torch.Tensor:
    """[kv_heads * head_dim] True on the `pairs` lowest-frequency RoPE pairs of each head (transformers' rotate-half
    layout: pair i is dims i and i + head_dim / 2; pair head_dim / 2 - 1 turns slowest)."""
    half = torch.zeros(head_dim // 2, dtype=torch.bool)
    if pairs:
        half[-pairs:] = True
    return torch.cat([half, half]).repeat(kv_heads)


def with_key_bias(model, means: list[torch.Tensor], mask: torch.Tensor) -> None:
    """k_proj of every layer gets bias -mean on `mask` (0 elsewhere): what config attention_bias would store."""
    for layer, mean in zip(model.model.layers, means):
        old = layer.self_attn.k_proj
        new = torch.nn.Linear(old.in_features, old.out_features, bias=True, dtype=old.weight.dtype)
        new.weight = old.weight
        with torch.no_grad():
            new.bias.copy_((-mean * mask).to(old.weight.dtype))
        layer.self_attn.k_proj = new


def mean_kl(model, layout, windows, reference, kv_dtype: str | None) -> float:
    """KL(reference || model) per token over the windows, the cache rounded as llama.cpp stores `kv_dtype` (None:
    unrounded)."""
    from kvconvert.ggml_formats import llamacpp_frames
    from kvconvert.quant.capture import cache_hook, forward_with_hook
    from kvconvert.token_stats import TokenSums, window_sums

    frames = llamacpp_frames(*kv_dtype.split("/"), layout.row_dim, mla=False) if kv_dtype else None
    hook = cache_hook(layout, lambda layer, kind, x: frames[kind].fake_quant(x) if frames else x)
    total = TokenSums()
    for ids, ref in zip(windows, reference):
        total += window_sums(forward_with_hook(model, ids[None], hook)[0], ids, ref)
    return total.kl / total.tokens


def current_rows(payload: dict, cmd: str | None = None) -> dict:
    """The centred rows for docs/BENCHMARKS.md's calibration table: each format's KL beside the source's."""
    source = next(r for r in payload["rows"] if r["pairs"] == 0)
    info = {k: payload[k] for k in ("device", "commit", "date")}
    rows = [(f"{payload['src']}: key mean removed on the {r['pairs']} slowest RoPE pairs (a k_proj bias), llama.cpp "
             f"caches, {payload['windows']} x 1024 essay tokens",
             f"KL unrounded {r['unrounded']:.5f}; " + ", ".join(f"{f} {r[f]:.4f} (source {source[f]:.4f})"
                                                              for f in FORMATS))
            for r in payload["rows"] if r["pairs"]]
    return {"calibration": bench_rows(rows, info, cmd)}


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    from kvconvert.checkpoint import read_config
    from kvconvert.data import calibration_windows
    from kvconvert.models.common import rope_parameters
    from kvconvert.quant.capture import load_hf_model
    from kvconvert.quant.layout import checkpoint_kv_layout

    path, tokenizer, windows, source = quant_eval_inputs(args.src, args.windows)
    layout = checkpoint_kv_layout(path)
    theta = rope_parameters(read_config(path), ("default", "linear", "llama3"))["rope_theta"]
    with torch.no_grad():
        reference = [source(w[None]).logits[0] for w in windows]
    means, mean_share = key_means(source, calibration_windows(tokenizer, "builtin", args.calib_tokens, 512))
    print(f"the key mean's share of the pre-RoPE keys' energy, per layer: {[round(x, 2) for x in mean_share]}")
    freqs = theta ** (-torch.arange(0, layout.head_dim, 2, dtype=torch.float64) / layout.head_dim)
    rows = []
    for pairs in (int(p) for p in args.pairs.split(",")):
        model = load_hf_model(path)
        with_key_bias(model, means, slow_pair_mask(layout.head_dim, layout.num_kv_heads, pairs))
        with torch.no_grad():
            row = {"pairs": pairs, "max_turn_rad_4096": float(freqs[-pairs] * 4096) if pairs else 0.0,
                   "unrounded": mean_kl(model, layout, windows, reference, None),
                   **{fmt: mean_kl(model, layout, windows, reference, fmt) for fmt in FORMATS}}
        rows.append(row)
        print(row, flush=True)
    lines = [f"{args.src}, {args.windows} x 1024 essay tokens, KL(source || model) per token; the k_proj bias minus "
             f"the key mean ({args.calib_tokens} pydoc tokens) on the slowest RoPE pairs; caches as llama.cpp "
             "stores them (rotation on).", "",
             "| centred pairs (turn over 4096 tokens) | unrounded | " + " | ".join(FORMATS) + " |",
             "|---|---:|" + "---:|" * len(FORMATS)]
    lines += [f"| {r['pairs']} ({r['max_turn_rad_4096']:.2f} rad) | {r['unrounded']:.6f} | "
              + " | ".join(f"{r[f]:.5f}" for f in FORMATS) + " |" for r in rows]
    table = "\n".join(lines)
    payload = {"src": args.src, "windows": args.windows, "calib_tokens": args.calib_tokens,
               "key_mean_energy_share": mean_share, "rows": rows, "markdown": table, **run_info()}
    payload["bench_rows"] = current_rows(payload, command())
    write_json(args.out, payload)
    publish_rows(payload, args.out)
    print(table)


if __name__ == "__main__":
    main()
