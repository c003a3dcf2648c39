#!/usr/bin/env python
"""Quality per KV byte on SmolLM2-135M: KV bytes per token against KL and perplexity, every artifact
kvconvert can build (the source or an MLA shape, x bf16 / fp8 / nvfp4, one-shot or healed), with the
Pareto frontier marked and each point labelled with the engines that serve it.

    python scripts/bench_frontier.py [--windows 32] [--shapes 256:64,160:32,64:32] [--calib-tokens 4096]

Points measured here: the source with a bf16 cache, and one-shot MLA conversions (8192 calibration
tokens, fp32) in bf16 and with calibrated fp8 / nvfp4 caches (calibrate's defaults on --calib-tokens
tokens). Points taken from earlier benchmarks keep their file and protocol (docs JSON named in each
row). Every KL is to the source with an fp32 cache, in transformers fp32 with the cache fake-quantized
(kvconvert.eval.kv_quant), on the essays (kvconvert.data.eval_windows); windows differ where stated.
Bytes per token: kvconvert.kvmath, equal to what the bundled runtime allocates (tests/test_kv_bytes.py).

Writes docs/bench_frontier.json, docs/img/frontier.png and the table between the frontier markers in
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path

from bench_common import (DOCS, bench_rows, calibrated_candidate, command, parser, publish_rows, quant_eval_inputs,
                          write_block, write_json)
from bench_mla import TRANSMLA

SMOLLM2 = "smollm2-135m"
HEALED = "healed CPU"  # the stage of --healed checkpoints (the recipes --healed takes heal on the CPU)
SHAPED, UNSHAPED = "shaped", "unshaped"  # added to the stage of points calibrated with --latent-shaping P > 0 / 0
CPU_HEAL_TOKENS = 82432  # the CPU recipes' heal (32768 + 512 layer-wise, 49152 distillation tokens): plain HEALED


def healed_stage(folder: Path) -> str:
    """HEALED, + ' <N>K' when its heals read more tokens than the CPU recipes, + ' QAT <format>' when its
    distillation went through a rounded cache (heal_distill.kv_dtype), all from the checkpoint's manifest:
    another stage, so --add keeps the other healed points of the shape beside it."""
    from kvconvert.checkpoint import healed_cache_format

    tokens = heal_tokens(folder)
    stage = HEALED if tokens <= CPU_HEAL_TOKENS else f"{HEALED} {round(tokens / 1000)}K"
    kv_dtype = healed_cache_format(folder)
    return f"{stage} QAT {kv_dtype}" if kv_dtype else stage


def heal_tokens(folder: Path, depth: int = 0) -> int:
    """Tokens the heals of the checkpoint in `folder` read, its student's heals included (a heal that
    continued a healed checkpoint), from the manifests."""
    from kvconvert.checkpoint import read_manifest

    heal = read_manifest(folder).get("kvconvert_heal", {})
    data = heal.get("data", {})
    tokens = data.get("layerwise", {}).get("tokens", 0) + data.get("distill", {}).get("tokens_requested", 0)
    student = Path(heal.get("student") or "")
    if depth < 8 and heal.get("student") and (student / "manifest.json").is_file():
        tokens += heal_tokens(student, depth + 1)
    return tokens


def candidates(shapes: list[tuple[int, int]]) -> dict:
    """plan's candidates for SmolLM2 by name (bytes, fraction, engines), and every format of the MLA
    ``shapes`` measured here that plan does not enumerate (checked before any work starts)."""
    from kvconvert.checkpoint import read_config
    from kvconvert.kvmath import kv_shape
    from kvconvert.mla.convert import validate_plan
    from kvconvert.mla.options import MLAOptions
    from kvconvert.plan import enumerate_candidates, shape_candidates
    from kvconvert.sources import resolve_source

    config = read_config(resolve_source(SMOLLM2))
    for rank, rope in shapes:  # what `kvconvert mla` would refuse (e.g. a RoPE split off frequency groups)
        validate_plan(config, MLAOptions(rank=rank, rope_dim=rope, target="any"))
    extra = [c for rank, rope in shapes for c in shape_candidates(kv_shape(config), rank, rope)]
    return {c.name: c for c in [*enumerate_candidates(config), *extra]}


def point(cands: dict, name: str, kl, ppl, source_ppl, stage: str, provenance: str, protocol: str) -> dict:
    """One point; source_ppl: the source's perplexity on the same windows (ppl increases compare across runs)."""
    c = cands[name]
    return {"name": f"{name} {stage}".strip(), "candidate": name, "stage": stage, "kv_dtype": c.kv_dtype,
            "rank": c.rank, "rope_dim": c.rope_dim, "bytes_per_token": c.bytes_per_token, "fraction": c.fraction,
            "engines": list(c.engines), "kl": kl, "ppl": ppl, "source_ppl": source_ppl,
            "ppl_increase_pct": 100 * (ppl / source_ppl - 1),
            "provenance": provenance, "protocol": protocol}


def earlier_points(cands: dict) -> list[dict]:
    """The points earlier benchmarks measured, with their files and protocols."""
    out = []
    cal = json.loads((DOCS / "bench_calibrate.json").read_text())
    proto = f"essays {cal['protocol']['windows']} x {cal['protocol']['window_len']}, calibrate defaults, " \
            f"{cal['protocol']['calib_tokens']} tokens"
    for row in cal["rows"]:
        if row["config"].endswith("(default)"):
            out.append(point(cands, f"source {row['kv_dtype']}", row["kl"], row["ppl"], cal["rows"][0]["ppl"], "",
                             "bench_calibrate.json", proto))
    heal_files = {"bench_heal_50pct.json": (160, 32), "bench_heal_33pct.json": (96, 32), "bench_heal.json": (64, 32),
                  "bench_heal_12pct.json": (32, 16)}
    for file, (rank, rope) in heal_files.items():
        doc = json.loads((DOCS / file).read_text())
        ((recipe, r),) = doc["recipes"].items()
        proto = f"{doc['protocol']['eval']}, recipe {recipe} (CPU heal: {r['heal']['tokens'] / 1e3:.0f}K tokens)"
        for stage, key in (("one-shot", "one-shot"), ("healed CPU", "healed")):
            m = r["metrics"][key]
            out.append(point(cands, f"MLA {rank}+{rope} bf16", m["kl_mean"], m["ppl"], r["metrics"]["source"]["ppl"],
                             stage, file, proto))
    gpu = json.loads((DOCS / "bench_heal_gpu.json").read_text())
    for recipe, r in gpu["recipes"].items():
        m = r["metrics"]["healed"]
        out.append(point(cands, f"MLA {r['rank']}+{r['rope_dim']} bf16", m["kl_mean"], m["ppl"],
                         r["metrics"]["source"]["ppl"], "healed GPU",
                         "bench_heal_gpu.json", f"{gpu['protocol']['eval']}, recipe {recipe} (H100 heal: "
                         f"{r['heal']['tokens'] / 1e6:.2f}M tokens)"))
    for setting, values in TRANSMLA.items():
        if setting != "source":
            rank, rope = map(int, setting.split(":"))
            out.append(point(cands, f"MLA {rank}+{rope} bf16", None, values[0], TRANSMLA["source"], "TransMLA one-shot",
                             "bench_mla.py TRANSMLA (TransMLA @9c0d254)",
                             "essays 32 x 1024, TransMLA's own conversion (source ppl 24.68)"))
    return out


def measure(cands: dict, shapes: list[tuple[int, int]], healed: dict[str, Path], args, work: Path, save) -> list[dict]:
    """Source bf16 cache, one-shot MLA shapes and healed MLA checkpoints, each in bf16 and in every quantized
    format plan knows, on args.windows x 1024; save(points so far) after each group, so an interrupted run
    keeps what it measured."""
    import torch

    from kvconvert.mla.convert import convert_to_mla
    from kvconvert.mla.options import MLAOptions
    from kvconvert.quant.capture import cache_hook
    from kvconvert.eval.kv_quant import evaluate_kv_quant
    from kvconvert.quant.layout import checkpoint_kv_layout

    src, _, windows, reference = quant_eval_inputs(SMOLLM2, args.windows)
    proto = f"essays {args.windows} x 1024"

    def log(msg):
        print(f"[{time.time() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)

    t0 = time.time()
    bf16 = cache_hook(checkpoint_kv_layout(src), lambda i, kind, x: x.to(torch.bfloat16).to(x.dtype))
    res = evaluate_kv_quant(reference, {"source bf16": (reference, bf16)}, windows)
    source_ppl = res["reference"].ppl
    out = [point(cands, "source bf16", res["source bf16"].kl, res["source bf16"].ppl, source_ppl, "", "measured here",
                 proto)]
    log(f"source bf16: {out[-1]['kl']:.5f}")
    save(out)
    for rank, rope in shapes:
        mla = work / f"mla-{rank}-{rope}"
        options = MLAOptions(rank=rank, rope_dim=rope, target="any", dtype="fp32", calib_tokens=args.convert_tokens)
        convert_to_mla(src, mla, options, overwrite=True, progress=False)
        log(f"converted {rank}:{rope}")
        note = f"conversion {args.convert_tokens} tokens of {options.calib_data}"
        out += measure_checkpoint(cands, mla, "one-shot", note, reference,
                                  windows, source_ppl, proto, args, work, log)
        save(out)
    for name, folder in healed.items():
        out += measure_checkpoint(cands, folder, healed_stage(folder), healed_note(name), reference, windows,
                                  source_ppl, proto, args, work, log)
        save(out)
    return out


def measure_checkpoint(cands: dict, mla: Path, stage: str, note: str, reference, windows, source_ppl: float,
                       proto: str, args, work: Path, log) -> list[dict]:
    """One MLA checkpoint in bf16 and calibrated (calibrate's defaults on args.calib_tokens) to every quantized
    format plan knows (fp8, nvfp4, nvfp4_fp8rope), evaluated side by side."""
    from kvconvert.checkpoint import read_config
    from kvconvert.plan import FORMATS
    from kvconvert.quant.capture import load_hf_model
    from kvconvert.eval.kv_quant import evaluate_kv_quant
    from kvconvert.quant.hooks import identity_hook
    from kvconvert.quant.options import CalibrateOptions

    config = read_config(mla)
    shape = f"MLA {config['kv_lora_rank']}+{config['qk_rope_head_dim']}"
    models = {(f"{shape} bf16", stage): (load_hf_model(mla), identity_hook)}
    for shaping in [None, *([] if args.latent_shaping is None else [args.latent_shaping])]:
        label = stage if shaping is None else f"{stage} {shaping_label(shaping)}"
        for kv in FORMATS[1:]:
            _, models[(f"{shape} {kv}", label)] = calibrated_candidate(
                mla, CalibrateOptions(kv_dtype=kv, calib_tokens=args.calib_tokens, latent_shaping=shaping),
                work / f"{mla.name}-{label.replace(' ', '-')}-{kv}")
            log(f"calibrated {shape} {label} {kv}")
    res = evaluate_kv_quant(reference, models, windows)
    out = []
    for (name, label), r in ((key, res[key]) for key in models):
        calib = "" if name.endswith("bf16") else f", calibrate defaults on {args.calib_tokens} tokens"
        if label != stage:
            calib += f" with --latent-shaping {args.latent_shaping}"
        elif calib:
            calib += " (latent shaping: the default)"
        out.append(point(cands, name, r.kl, r.ppl, source_ppl, label, "measured here", f"{proto}; {note}{calib}"))
        log(f"{name} {label}: KL {r.kl:.4f} ppl {r.ppl:.2f}")
    return out


def shaping_label(power: float) -> str:
    return SHAPED if power > 0 else UNSHAPED


def markdown(doc: dict) -> str:
    from kvconvert.plan import format_kl

    runs = "".join(f" Rows marked *earlier run*: `{r['command']}` ({r['seconds']:.0f} s), same protocol."
                   for r in doc.get("earlier_runs", []))
    lines = [f"`{doc['command']}` ({doc['seconds']:.0f} s wall, {doc['threads']} thread, on the shared 2-core "
             f"machine).{runs} KL to the source (fp32 cache), transformers fp32 with the cache fake-quantized; "
             "**frontier** = no other point has fewer or equal bytes and less damage (KL; TransMLA, which has no KL, "
             "by perplexity increase over the source on the same windows). "
             "Rows from earlier benchmarks keep their file and protocol.", "",
             "| point | KV bytes/token | of bf16 | served by | KL | ppl (vs source on its windows) | frontier | source, protocol |",
             "|---|---|---|---|---|---|---|---|"]
    for p in sorted(doc["points"], key=lambda p: (-p["fraction"], p["kl"] if p["kl"] is not None else 9)):
        kl = format_kl(p["kl"])
        lines.append(f"| {p['name']} | {p['bytes_per_token']} | {p['fraction']:.1%} | {', '.join(p['engines'])} | "
                     f"{kl} | {p['ppl']:.2f} ({p['ppl_increase_pct']:+.1f}%) | {'**yes**' if p['on_front'] else ''} | {p['provenance']}: "
                     f"{p['protocol']} |")
    return "\n".join(lines)


def main():
    ap = parser(__doc__)
    ap.add_argument("--windows", type=int, default=32, help="essay windows of 1024 tokens for the points measured here")
    ap.add_argument("--shapes", default="256:64,160:32,64:32", help="one-shot MLA shapes measured here ('' for none)")
    ap.add_argument("--healed", action="append", default=[], metavar="NAME=DIR",
                    help="a healed MLA checkpoint (bench_heal.py's WORK/NAME/healed) measured in every format, as "
                         f"'{HEALED}' ('{HEALED} QAT <format>' when its distillation was quantization-aware; "
                         "repeatable)")
    ap.add_argument("--convert-tokens", type=int, default=8192, help="calibration tokens of the MLA conversions")
    ap.add_argument("--calib-tokens", type=int, default=4096, help="KV calibration tokens of the MLA points")
    ap.add_argument("--latent-shaping", type=float, default=None,
                    help="also calibrate every MLA point's quantized formats with calibrate --latent-shaping P "
                         f"(stage '... {SHAPED}', or '... {UNSHAPED}' for 0), beside the default calibration")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-measure", action="store_true", help="only re-render from docs/bench_frontier.json")
    ap.add_argument("--add", action="store_true",
                    help="measure the source and --shapes, and keep the other MLA shapes docs/bench_frontier.json "
                         "measured (marked as an earlier run, its command kept)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.time()
    shapes = [tuple(map(int, setting.split(":"))) for setting in args.shapes.split(",") if setting]
    healed = {}
    for item in args.healed:
        name, _, folder = item.partition("=")
        if not (Path(folder) / "config.json").is_file():
            ap.error(f"--healed {item}: give NAME=DIR, DIR a healed MLA checkpoint (no config.json there)")
        healed[name] = Path(folder)
    from kvconvert.checkpoint import read_config
    healed_groups = [(c["kv_lora_rank"], c["qk_rope_head_dim"], healed_stage(folder))
                     for folder, c in zip(healed.values(), map(read_config, healed.values()))]
    cands = candidates([*shapes, *(g[:2] for g in healed_groups)])  # refuses what kvconvert cannot build, up front
    earlier = earlier_points(cands)
    if args.skip_measure:  # the points measured here, with the earlier ones read afresh from their files
        doc = json.loads((DOCS / "bench_frontier.json").read_text())
        return write({**doc, "points": [p for p in doc["points"]
                                        if p["provenance"] in ("measured here", "earlier run")] + earlier}, measured=False)
    # (rank, rope, stage, healed NAME or None): a healed checkpoint replaces only its own earlier points, so
    # another checkpoint of the same stage (e.g. a second heal seed) is measured beside the first
    groups = [(*shape, "one-shot", None) for shape in shapes] + [(*g, name) for g, name in zip(healed_groups, healed)]
    remeasured = set(groups)
    if args.latent_shaping is not None:
        label = shaping_label(args.latent_shaping)
        remeasured |= {(*g[:2], f"{g[2]} {label}", g[3]) for g in groups}
    kept, earlier_runs = earlier_run_points(remeasured) if args.add else ([], [])
    with tempfile.TemporaryDirectory(prefix="bench_frontier_") as tmp:
        measure(cands, shapes, healed, args, Path(tmp), lambda measured: write(
            {"command": command(), "threads": args.threads, "seconds": time.time() - t0, "earlier_runs": earlier_runs,
             "points": measured + kept + earlier}))


def earlier_run_points(remeasured: set[tuple[int, int, str, str | None]]) -> tuple[list[dict], list[dict]]:
    """(the MLA points the last run measured, except the groups this run measures again, relabelled as an
    earlier run; that run's commands), for --add. A group is (rank, rope, stage, healed NAME or None);
    a healed group matches only the points whose protocol says "healed by NAME"."""
    doc = json.loads((DOCS / "bench_frontier.json").read_text())
    runs = [*doc.get("earlier_runs", []), {"command": doc["command"], "seconds": doc["seconds"]}]
    kept = [{**p, "provenance": "earlier run"} for p in doc["points"]
            if p["provenance"] in ("measured here", "earlier run") and p["rank"] is not None
            and not any(remeasured_by(p, group) for group in remeasured)]
    return kept, runs


def healed_note(name: str) -> str:
    """A healed point's note in its protocol (followed by ", calibrate ..." or nothing), read back by remeasured_by."""
    return f"healed by {name}"


def remeasured_by(p: dict, group: tuple[int, int, str, str | None]) -> bool:
    rank, rope, stage, healed_name = group
    return ((p["rank"], p["rope_dim"], p["stage"]) == (rank, rope, stage)
            and (healed_name is None or re.search(rf"{re.escape(healed_note(healed_name))}(,|$)", p["protocol"]) is not None))


def current_rows(doc: dict, info: dict | None = None, cmd: str | None = None) -> dict:
    """The frontier points this run measured, for docs/BENCHMARKS.md's current tables: the source's cache formats
    (calibration), one-shot MLA points (conversion), healed ones (healing)."""
    stages: dict[str, list] = {}
    for p in doc["points"]:
        if p["provenance"] != "measured here" or not p.get("on_front"):
            continue
        stage = "calibration" if p["rank"] is None else "healing" if "healed" in p["stage"] else "conversion"
        kl = f"KL {p['kl']:.4f}, " if p["kl"] is not None else ""
        stages.setdefault(stage, []).append((
            f"SmolLM2-135M {p['name']}, {p['bytes_per_token']} KV bytes/token ({p['fraction']:.1%} of bf16): KL and ppl "
            f"vs the source ({p['protocol']})", f"{kl}ppl {p['ppl']:.2f} ({p['ppl_increase_pct']:+.1f}%)"))
    return {stage: bench_rows(rows, info, cmd or doc.get("command")) for stage, rows in stages.items()}


def write(doc: dict, measured: bool = True) -> None:
    """bench_frontier.json, img/frontier.png and the BENCHMARKS.md table from doc's points; when this run
    measured them, their rows of the current tables too (a re-render keeps the recorded ones)."""
    from kvconvert.plan import pareto_front, plot_frontier

    points = doc["points"]
    with_kl = [p for p in points if p["kl"] is not None]
    kl_front = {id(with_kl[i]) for i in pareto_front([(p["fraction"], p["kl"]) for p in with_kl])}
    ppl_front = {id(points[i]) for i in pareto_front([(p["fraction"], p["ppl_increase_pct"]) for p in points])}
    for p in points:  # TransMLA has perplexities only: its points are placed by perplexity
        p["on_front"] = id(p) in (kl_front if p["kl"] is not None else ppl_front)
    if measured:
        doc["bench_rows"] = current_rows(doc)
    write_json(DOCS / "bench_frontier.json", doc, indent=1)
    if measured:
        publish_rows(doc, DOCS / "bench_frontier.json")
    (DOCS / "img").mkdir(exist_ok=True)
    plot_frontier(points, DOCS / "img" / "frontier.png", "SmolLM2-135M: damage per KV byte", metrics=("kl", "ppl_increase_pct"))
    table = markdown(doc)
    write_block("frontier", table)
    print(table, flush=True)

if __name__ == "__main__":
    main()
