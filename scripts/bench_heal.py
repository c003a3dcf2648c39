#!/usr/bin/env python
"""Benchmark MLA conversion + healing on SmolLM2-135M: one-shot vs healed, against the source.

For each recipe (default: recipes/smollm2-135m-{25,50,33,12}pct.yaml): convert the source with the
recipe's `convert` block, heal with its heal_* blocks (timed), then measure on identical held-out
essay windows (kvconvert.data.eval_windows) the perplexity and mean next-token KL(source || model)
of the one-shot conversion and of the healed model, and passkey accuracy (greedy, plain prompt) at
the given lengths. Writes docs/bench_heal.json (updated after every recipe, so a partial run keeps
its results) and prints a markdown table for docs/BENCHMARKS.md.

    python scripts/bench_heal.py                         # the full protocol (hours on 2 shared cores)
    python scripts/bench_heal.py --recipes recipes/smollm2-135m-25pct.yaml --windows 8 --passkey 5
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import torch
from bench_common import DOCS, ROOT, bench_rows, parse_corpora, parser, publish_rows, run_info, stopwatch, write_json

DEFAULT_RECIPES = [f"recipes/smollm2-135m-{p}pct.yaml" for p in (25, 50, 33, 12)]
TARGETS = {"ppl_increase_pct": 5.0, "kl_mean": 0.05, "passkey_drop": 0.1}


def parse_args(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--source", default="smollm2-135m", help="source model (HF folder or built-in name)")
    ap.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "kvconvert-bench-heal")
    ap.add_argument("--windows", type=int, default=32, help="held-out essay windows (protocol: 32)")
    ap.add_argument("--window-len", type=int, default=1024)
    ap.add_argument("--corpus", action="append", default=[],
                    help="a second held-out corpus, FILE:WINDOWS (any source kvconvert.data.load_text reads); "
                         "repeatable; measured beside the essays, reported under metrics.corpora")
    ap.add_argument("--passkey", type=int, default=10, help="passkey prompts per length (0 = skip)")
    ap.add_argument("--passkey-lengths", default="1024,2048")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 is fastest on a shared CPU)")
    ap.add_argument("--device", default=None,
                    help="device for the layer-wise stage, teacher data and evaluation (default: cuda if visible)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse converted/healed folders already in --work and resume an interrupted heal")
    ap.add_argument("--out", type=Path, default=DOCS / "bench_heal.json")
    return ap.parse_args(argv)


def convert(source: Path, recipe, folder: Path, reuse: bool) -> dict:
    from kvconvert.mla.convert import convert_to_mla

    if reuse and (folder / "config.json").is_file():
        return {"seconds": None, "reused": True}
    with stopwatch() as times:
        convert_to_mla(source, folder, recipe.stage("convert"), overwrite=True, progress=False)
    return times


def heal_once(converted: Path, source: Path, recipe, folder: Path, reuse: bool, device: str) -> dict:
    from kvconvert.recipe import heal

    if reuse and (folder / "heal_report.json").is_file():
        rep = json.loads((folder / "heal_report.json").read_text())
        return {"reused": True, **_heal_summary(rep)}
    with stopwatch() as times:
        rep = heal(converted, source, recipe, folder, overwrite=True, progress=True, restart=not reuse, device=device)
    return {**times, **_heal_summary(rep)}


def _heal_summary(rep: dict) -> dict:
    out = {}
    if lw := rep["stages"].get("heal_layerwise"):
        out["layerwise"] = {k: lw[k] for k in lw if k != "layers"}
        out["layerwise_tokens"] = rep["data"]["layerwise"]["tokens"]
    if ds := rep["stages"].get("heal_distill"):
        out["distill"] = ds
        out["distill_tokens"] = ds.get("tokens", 0)
    out["tokens"] = out.get("layerwise_tokens", 0) + out.get("distill_tokens", 0)
    return out


def evaluate(source: Path, models: dict[str, Path], args, tokenizer, cache: dict) -> dict:
    from kvconvert.data import eval_windows
    from kvconvert.heal.evaluate import passkey_accuracy, passkey_samples, window_metrics
    from kvconvert.quant.capture import load_hf_model

    ids = eval_windows(tokenizer, args.windows, args.window_len)
    src_model = load_hf_model(source).to(args.device)
    cands = {name: load_hf_model(path).to(args.device) for name, path in models.items()}
    res = window_metrics(src_model, cands, ids, progress=True)
    extra = parse_corpora(args.corpus, args.windows) if args.corpus else {}
    res["corpora"] = {corpus: window_metrics(src_model, cands, eval_windows(tokenizer, n, args.window_len, corpus))
                      for corpus, n in extra.items()}
    if args.passkey:
        lengths = tuple(int(x) for x in args.passkey_lengths.split(","))
        samples = passkey_samples(tokenizer, lengths, args.passkey)
        if "source_passkey" not in cache:
            cache["source_passkey"] = passkey_accuracy(src_model, tokenizer, samples)
        res["source"]["passkey"] = cache["source_passkey"]
        for name, model in cands.items():
            res[name]["passkey"] = passkey_accuracy(model, tokenizer, samples)
    return res


def meets(metrics: dict, source_passkey: dict | None) -> dict:
    ok = {"ppl": metrics["ppl_increase_pct"] <= TARGETS["ppl_increase_pct"], "kl": metrics["kl_mean"] <= TARGETS["kl_mean"]}
    if source_passkey and "passkey" in metrics:
        ok["passkey"] = all(metrics["passkey"][k] >= source_passkey[k] - TARGETS["passkey_drop"] - 1e-9
                            for k in source_passkey)
    return ok


def markdown(results: dict) -> str:
    rows = ["| KV | rank+rope | model | ppl (vs source) | KL(src‖model) | passkey 1K / 2K | heal time (wall / CPU) | heal tokens | targets |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["recipes"].items():
        m = r.get("metrics")
        if not m:
            continue
        src = m["source"]
        src_pk = src.get("passkey")
        for label in ("one-shot", "healed"):
            x = m[label]
            pk = " / ".join(f"{x['passkey'][k] * 100:.0f}%" for k in x["passkey"]) if "passkey" in x else "-"
            if label == "healed":
                h = r["heal"]
                time_s = f"{h.get('seconds', 0) / 60:.1f} / {h.get('cpu_seconds', 0) / 60:.1f} min"
                tokens = f"{h.get('tokens', 0):,}"
                ok = meets(x, src_pk)
                verdict = ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in ok.items())
            else:
                time_s, tokens, verdict = "-", "-", "-"
            rows.append(f"| {r['kv_pct']:.1f}% | {r['rank']}+{r['rope_dim']} | {label} | {x['ppl']:.2f} "
                        f"({x['ppl_increase_pct']:+.1f}%) | {x['kl_mean']:.4f} | {pk} | {time_s} | {tokens} | {verdict} |")
    src = results.get("source_metrics", {})
    if src:
        pk = " / ".join(f"{v * 100:.0f}%" for v in src.get("passkey", {}).values()) or "-"
        rows.append(f"| 100% | source | source | {src['ppl']:.2f} | 0 | {pk} | - | - | - |")
    return "\n".join(rows + corpora_markdown(results))


def corpora_markdown(results: dict) -> list[str]:
    """The second held-out corpora (--corpus), one row per recipe, corpus and model."""
    rows = [(name, corpus, m) for name, r in results["recipes"].items()
            for corpus, m in r.get("metrics", {}).get("corpora", {}).items()]
    if not rows:
        return []
    out = ["", "| recipe | held-out corpus | source ppl | one-shot ppl / KL | healed ppl / KL |", "|---|---|---|---|---|"]
    for name, corpus, m in rows:
        one, healed = m["one-shot"], m["healed"]
        out.append(f"| {name} | {Path(corpus).name} | {m['source']['ppl']:.2f} | {one['ppl']:.2f} / {one['kl_mean']:.4f} "
                   f"| {healed['ppl']:.2f} / {healed['kl_mean']:.4f} |")
    return out


def current_rows(results: dict, info: dict | None = None, cmd: str | None = None) -> dict:
    """Each healed recipe's row for docs/BENCHMARKS.md's healing table: ppl and KL against the source (bf16
    cache), passkey where measured, the heal's wall time and tokens."""
    rows = []
    for name, r in results["recipes"].items():
        x, heal = r.get("metrics", {}).get("healed"), r.get("heal", {})
        if not x:
            continue
        passkey = (", passkey " + " / ".join(f"{v * 100:.0f}%" for v in x["passkey"].values())) if "passkey" in x else ""
        rows.append((f"{results['protocol']['source']} MLA {r['rank']}+{r['rope_dim']} healed by {name}: ppl and KL "
                     f"vs the source ({results['protocol']['eval']})",
                     f"ppl {x['ppl']:.2f} ({x['ppl_increase_pct']:+.1f}%), KL {x['kl_mean']:.4f}{passkey}; heal "
                     f"{heal.get('seconds', 0) / 60:.1f} min wall, {heal.get('tokens', 0):,} tokens"))
    return {"healing": bench_rows(rows, info, cmd)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from kvconvert.device import default_device
    from kvconvert.kvmath import kv_shape
    from kvconvert.recipe import load_recipe
    from kvconvert.sources import resolve_source

    args.device = args.device or default_device()
    source = resolve_source(args.source)
    source_values = kv_shape(json.loads((source / "config.json").read_text())).values_per_token_per_layer
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    results = {"protocol": {"source": str(args.source), "eval": f"{args.windows} x {args.window_len} essay tokens",
                            "passkey": f"{args.passkey} per length at {args.passkey_lengths}", "targets": TARGETS},
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                           "device": args.device, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                           "load_avg_start": os.getloadavg()},
               "recipes": {}}
    cache: dict = {}
    for recipe_path in args.recipes:
        recipe = load_recipe(ROOT / recipe_path if not Path(recipe_path).is_absolute() else recipe_path)
        name = recipe.name or Path(recipe_path).stem
        work = args.work / name
        print(f"== {name}", file=sys.stderr)
        entry = {"recipe": str(recipe_path), "rank": recipe.convert.rank, "rope_dim": recipe.convert.rope_dim,
                 "kv_pct": 100 * (recipe.convert.rank + (recipe.convert.rope_dim or 64)) / source_values}
        entry["convert"] = convert(source, recipe, work / "converted", args.reuse)
        entry["heal"] = heal_once(work / "converted", source, recipe, work / "healed", args.reuse, args.device)
        entry["metrics"] = evaluate(source, {"one-shot": work / "converted", "healed": work / "healed"}, args, tokenizer, cache)
        results["source_metrics"] = entry["metrics"]["source"]
        results["recipes"][name] = entry
        write_json(args.out, results)
    results["markdown"] = markdown(results)
    results["bench_rows"] = current_rows(results, run_info(args.device))
    write_json(args.out, results)
    publish_rows(results, args.out)
    print(results["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
