#!/usr/bin/env python
"""Benchmark `kvconvert mla`: quality vs TransMLA on SmolLM2-135M, and streaming memory/time on a
random-weight checkpoint in Llama-2-7B's shapes.

  python scripts/bench_mla.py smollm2 [--windows 32] [--settings 160:32,96:32,64:32,32:16]
      [--variant NAME=CONVERTER_FLAGS ...] [--corpus essays --corpus FILE:WINDOWS ...] [--json FILE]
  python scripts/bench_mla.py llama7b [--workdir /tmp/kvc-bench] [--calib-tokens 512]

Writes docs/bench_mla.json (merged per section) and prints a markdown table for docs/BENCHMARKS.md.
Perplexity protocol: the Paul Graham essays, N windows of 1024 tokens, fp32, no special tokens.
--variant compares converter options side by side (same calibration tokens, same windows), e.g.
--variant base= --variant "k01=--key-weight 0.1"; --corpus adds held-out corpora (any
source kvconvert.data.load_text reads), each with its own window count after a colon.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_common import DOCS, bench_rows, command, parse_corpora, parser, publish_rows, write_json

JSON_OUT = DOCS / "bench_mla.json"
# TransMLA @9c0d254 on SmolLM2-135M, one-shot, same essays protocol (32 x 1024), measured on this
# machine class (the reference of the one-shot bar): setting -> (perplexity, seconds, peak RSS GB).
TRANSMLA = {"source": 24.68, "160:32": (57.76, 104, 7.6), "96:32": (99.29, 101, 7.5),
            "64:32": (149.84, 98, 7.5), "32:16": (286.34, 165, 7.7)}


def eval_model(path: Path, windows: int, ref: Path, corpus: str = "essays", save_ref: bool = False):
    """(perplexity, mean token KL(reference || model)) on `windows` x 1024 tokens of `corpus`.

    ref: a folder of the reference's per-window log-probs [1023, vocab] bf16 (save_ref: write them
    there instead; on disk, as 32 windows x 49152 vocab hold 3.2 GB, too much to keep in memory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvconvert.data import eval_windows
    from kvconvert.token_stats import TokenSums, window_sums

    ids = eval_windows(AutoTokenizer.from_pretrained(path), windows, 1024, corpus)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sums = TokenSums()
    ref.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for i in range(windows):
            logits = model(ids[i: i + 1]).logits[0]
            if save_ref:
                torch.save(logits[:-1].float().log_softmax(-1).to(torch.bfloat16), ref / f"{i}.pt")
            sums += window_sums(logits, ids[i], None if save_ref else torch.load(ref / f"{i}.pt"))
    return sums.ppl, sums.kl_mean


def convert_subprocess(src: str, out: Path, rank: int, rope: int, extra: list[str]) -> dict:
    """Run the real CLI in a child process; its peak RSS comes from RUSAGE_CHILDREN."""
    cmd = [sys.executable, "-m", "kvconvert.cli", "mla", "--src", src, "--rank", str(rank), "--rope-dim", str(rope),
           "--target", "any", "--out", str(out), "--overwrite", "--json", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"conversion failed:\n{proc.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    summary.update(wall_seconds=round(seconds, 1), child_peak_rss_mb=round(max(peak, before) / 1024))
    return summary


def source_ppl(src: Path, windows: int, ref: Path, corpus: str) -> float:
    """The source's perplexity; its log-probs are saved under ref, or read back from there when an
    earlier run on the same --workdir saved them (parallel runs of other settings share them)."""
    import torch
    from transformers import AutoTokenizer

    from kvconvert.data import eval_windows
    from kvconvert.token_stats import TokenSums, window_sums

    if not all((ref / f"{i}.pt").is_file() for i in range(windows)):
        return eval_model(src, windows, ref, corpus, save_ref=True)[0]
    ids = eval_windows(AutoTokenizer.from_pretrained(src), windows, 1024, corpus)
    return sum((window_sums(torch.load(ref / f"{i}.pt"), ids[i]) for i in range(windows)), TokenSums()).ppl


def bench_smollm2(args) -> dict:
    from kvconvert.sources import resolve_source

    src = resolve_source("smollm2-135m")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    variants = dict(v.split("=", 1) for v in args.variant or ["oneshot="])
    corpora = parse_corpora(args.corpus, args.windows)
    refs = {c: work / f"ref-{i}" for i, c in enumerate(corpora)}  # the source's log-probs per corpus
    source = {c: source_ppl(src, n, refs[c], c) for c, n in corpora.items()}
    rows = []
    for setting in args.settings.split(","):
        rank, rope = map(int, setting.split(":"))
        for name, flags in variants.items():
            out = work / f"smollm2-mla-{rank}-{rope}-{name}"
            conv = convert_subprocess(str(src), out, rank, rope, ["--dtype", "fp32", "--calib-tokens",
                                                                  str(args.calib_tokens), *flags.split()])
            rows.append(_row(setting, rank, rope, name, flags, conv, out, corpora, source, refs))
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(out, ignore_errors=True)
    first = next(iter(corpora))
    return {"windows": corpora[first], "calib_tokens": args.calib_tokens, "source_ppl": source[first],
            "corpora": {c: {"windows": n, "source_ppl": source[c]} for c, n in corpora.items()}, "rows": rows}


def _row(setting, rank, rope, variant, flags, conv, out, corpora, source, refs) -> dict:
    """One conversion's row: the first corpus's ppl/KL at the top level (the published table's
    columns), every corpus's under "corpora"."""
    scores = {}
    for corpus, n in corpora.items():
        ppl, kl = eval_model(out, n, refs[corpus], corpus)
        scores[corpus] = {"ppl": ppl, "kl": kl, "source_ppl": source[corpus]}
    first = scores[next(iter(corpora))]
    tm = TRANSMLA.get(setting)
    row = dict(setting=setting, variant=variant, flags=flags, rank=rank, rope_dim=rope, kv_fraction=(rank + rope) / 384,
               **first, convert_seconds=conv["wall_seconds"], peak_rss_mb=conv["child_peak_rss_mb"],
               transmla_ppl=tm[0] if tm else None, corpora=scores)
    if tm:  # the bar: our increase at most half of TransMLA's (TransMLA measured with source 24.68)
        row["bar_ppl"] = first["source_ppl"] + 0.5 * (tm[0] - TRANSMLA["source"])
        row["meets_bar"] = first["ppl"] <= row["bar_ppl"]
    return row


# Real configs' shapes for random-weight checkpoints (the vocabulary is SmolLM2's 49152 so its
# tokenizer fits: TinyLlama's 32000 and Llama-2's 32000 would leave tokenizer ids out of range).
LLAMA_SHAPES = {
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, head_dim=64, max_position_embeddings=2048),
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, head_dim=128, max_position_embeddings=4096),
}
RANDOM_VOCAB = 49152


def write_random_llama(folder: Path, tokenizer_dir: Path, shape: str = "llama-2-7b", layers: int | None = None) -> None:
    """Random bf16 weights in a real Llama config's shapes (LLAMA_SHAPES), written layer by layer
    so this process never holds the model. Shared by bench_mla.py and bench_memory.py."""
    import torch  # here, not at the top: bench_memory imports this module and must stay small
    from kvconvert.checkpoint import CheckpointWriter

    dims = dict(LLAMA_SHAPES[shape])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    hid, inter, vocab = dims["hidden_size"], dims["intermediate_size"], RANDOM_VOCAB
    q_dim = dims["num_attention_heads"] * dims["head_dim"]
    kv_dim = dims["num_key_value_heads"] * dims["head_dim"]
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **dims, "vocab_size": vocab,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
           "torch_dtype": "bfloat16"}
    with CheckpointWriter(folder, overwrite=True, source=f"random {shape} shapes", max_shard_bytes=2 * 2**30) as w:
        w.add("model.embed_tokens.weight", rnd(vocab, hid))
        for i in range(dims["num_hidden_layers"]):
            p = f"model.layers.{i}."
            for name, rows in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
                w.add(p + f"self_attn.{name}.weight", rnd(rows, hid))
            w.add(p + "self_attn.o_proj.weight", rnd(hid, q_dim))
            w.add(p + "mlp.gate_proj.weight", rnd(inter, hid))
            w.add(p + "mlp.up_proj.weight", rnd(inter, hid))
            w.add(p + "mlp.down_proj.weight", rnd(hid, inter))
            w.add(p + "input_layernorm.weight", torch.ones(hid, dtype=torch.bfloat16))
            w.add(p + "post_attention_layernorm.weight", torch.ones(hid, dtype=torch.bfloat16))
        w.add("model.norm.weight", torch.ones(hid, dtype=torch.bfloat16))
        w.add("lm_head.weight", rnd(vocab, hid))
        w.write_config(cfg)
        w.copy_tokenizer(tokenizer_dir)


def bench_llama7b(args) -> dict:
    from kvconvert.sources import resolve_source

    work = Path(args.workdir)
    src = work / "llama-2-7b-random"
    if not (src / "config.json").is_file():
        t0 = time.time()
        write_random_llama(src, resolve_source("smollm2-135m"), "llama-2-7b", args.layers)
        print(f"wrote {src} in {time.time() - t0:.0f} s", flush=True)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    out = work / "llama-2-7b-mla"
    conv = convert_subprocess(str(src), out, args.rank, 64, ["--calib-tokens", str(args.calib_tokens),
                                                             "--calib-window", "256", "--dtype", "bf16"])
    out_size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    row = dict(layers=args.layers, source_gb=size / 1e9, output_gb=out_size / 1e9, rank=args.rank, rope_dim=64,
               calib_tokens=args.calib_tokens, convert_seconds=conv["wall_seconds"], peak_rss_mb=conv["child_peak_rss_mb"])
    print(json.dumps(row), flush=True)
    return row


def markdown(results: dict) -> str:
    lines = []
    if "smollm2" in results:
        r = results["smollm2"]
        lines += [f"SmolLM2-135M-Instruct one-shot (`--heal none`), essays {r['windows']} x 1024 tokens, fp32, "
                  f"calibration {r['calib_tokens']} tokens of the built-in corpus. Source perplexity {r['source_ppl']:.2f}.", "",
                  "| rank+rope | KV kept | kvconvert ppl | KL | TransMLA ppl | bar (half of TransMLA's increase) | meets bar | convert s | peak RSS MB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            lines.append(f"| {row['rank']}+{row['rope_dim']} | {row['kv_fraction']:.1%} | {row['ppl']:.2f} | {row['kl']:.3f} | "
                         f"{row.get('transmla_ppl') or '-'} | {row.get('bar_ppl', float('nan')):.1f} | "
                         f"{'yes' if row.get('meets_bar') else 'no'} | {row['convert_seconds']} | {row['peak_rss_mb']} |")
    if "oneshot" in results:
        lines += variants_markdown(results["oneshot"])
    if "llama7b" in results:
        r = results["llama7b"]
        lines += ["", f"Streaming: random weights in Llama-2-7B shapes ({r['layers']} layers, {r['source_gb']:.1f} GB bf16) -> "
                  f"rank {r['rank']} + rope 64, {r['calib_tokens']} calibration tokens: {r['convert_seconds']} s, "
                  f"peak RSS {r['peak_rss_mb']} MB, output {r['output_gb']:.1f} GB."]
    return "\n".join(lines)


def variants_markdown(r: dict) -> list[str]:
    """The --variant comparison: one row per setting and variant, ppl and KL on every corpus."""
    corpora = r["corpora"]
    names = [Path(c).stem for c in corpora]
    head = "| KV kept (rank+rope) | variant | " + " | ".join(f"{n} ppl | {n} KL" for n in names) + " | convert s |"
    lines = ["Source perplexity: " + ", ".join(f"{Path(c).stem} {v['source_ppl']:.2f} ({v['windows']} x 1024)"
                                                 for c, v in corpora.items()) + ".", "", head,
             "|" + "---|" * (3 + 2 * len(names))]
    for row in r["rows"]:
        cells = " | ".join(f"{row['corpora'][c]['ppl']:.2f} | {row['corpora'][c]['kl']:.3f}" for c in corpora)
        lines.append(f"| {row['kv_fraction']:.1%} ({row['rank']}+{row['rope_dim']}) | {row['variant']} "
                     f"(`{row['flags'] or 'defaults'}`) | {cells} | {row['convert_seconds']} |")
    return lines


def converter_options(flags: str) -> dict:
    """A --variant's converter flags as {"--flag": "value" or ""}, in their order."""
    words, options = flags.split(), {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
            options[word] = value
    return options


def current_rows(section: str, r: dict, info: dict | None = None, cmd: str | None = None,
                 default_text: str | None = None) -> dict:
    """One section's rows for docs/BENCHMARKS.md's current tables: each SmolLM2 conversion's ppl / KL per held-out
    corpus (conversion), the 7B-shaped conversion's peak RSS and time (memory). The calibration text and tokens
    are named from the row's flags, else the converter's defaults (default_text: kvconvert.mla.options)."""
    if section == "llama7b":
        return {"memory": bench_rows([(
            f"Llama-2-7B-shaped random bf16 ({r['layers']} layers, {r['source_gb']:.1f} GB) -> MLA {r['rank']}+"
            f"{r['rope_dim']}, {r['calib_tokens']} calibration tokens: `kvconvert mla` peak RSS and wall time",
            f"{r['peak_rss_mb'] / 1000:.2f} GB (converter process), {r['convert_seconds']:.0f} s; output "
            f"{r['output_gb']:.1f} GB")], info, cmd or r.get("command"))}
    if default_text is None:
        from kvconvert.mla.options import DEFAULT_CONVERT_TEXT as default_text
    corpora = r.get("corpora") or {"essays": {"windows": r["windows"]}}
    rows = []
    for row in r["rows"]:
        options = converter_options(row.get("flags", ""))
        text = options.pop("--calib-data", default_text)
        tokens = options.pop("--calib-tokens", r["calib_tokens"])
        rest = "".join(f", {k} {v}".rstrip() for k, v in options.items())
        scores = row.get("corpora") or {"essays": row}
        where = ", ".join(f"{Path(c).stem} {v['windows']} x 1024" for c, v in corpora.items())
        rows.append((f"SmolLM2-135M MLA {row['rank']}+{row['rope_dim']} ({row['kv_fraction']:.1%} of the KV values) "
                     f"one-shot, {tokens} calibration tokens of {text}{rest}: ppl / KL ({where})",
                     "; ".join(f"{Path(c).stem} {s['ppl']:.2f} / {s['kl']:.3f}" for c, s in scores.items())))
    return {"conversion": bench_rows(rows, info, cmd or r.get("command"))}


def main():
    ap = parser(__doc__)
    ap.add_argument("which", choices=["smollm2", "llama7b"])
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--settings", default="160:32,96:32,64:32,32:16")
    ap.add_argument("--calib-tokens", type=int, default=None)
    ap.add_argument("--workdir", default=os.environ.get("TMPDIR", "/tmp") + "/kvc-bench")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--keep", action="store_true", help="keep the random 7B source for reruns")
    ap.add_argument("--variant", action="append", help="NAME=CONVERTER_FLAGS (repeatable; default oneshot=)")
    ap.add_argument("--corpus", action="append", help="held-out corpus[:windows] (repeatable; default essays)")
    ap.add_argument("--json", type=Path, default=JSON_OUT, help="results file (merged per section)")
    args = ap.parse_args()
    args.calib_tokens = args.calib_tokens or (8192 if args.which == "smollm2" else 512)
    results = json.loads(args.json.read_text()) if args.json.is_file() else {}
    section = "oneshot" if args.which == "smollm2" and args.variant else args.which  # never replaces published rows
    results[section] = bench_smollm2(args) if args.which == "smollm2" else bench_llama7b(args)
    results[section]["command"] = command()
    results[section]["bench_rows"] = current_rows(section, results[section])
    write_json(args.json, results)
    publish_rows(results[section], args.json)
    print(markdown(results))


if __name__ == "__main__":
    main()
