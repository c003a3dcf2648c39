"""KV caches of SmolLM2-135M by format and engine: bytes, perplexity, KL and the default gate's verdict on the
essays, for the formats vLLM / TensorRT-LLM and llama.cpp serve, with and without kvconvert's model-side rewrites.

    python scripts/bench_kv4bit.py --windows 8 --window-len 1024 --work out/bench-kv4bit --json docs/bench_kv4bit.json

(docs/bench_kv4bit.json: 8 windows, rows measured by the runs each row records; --rows N,M runs some; row 20, the
source healed for its q5_0/iq4_nl cache on HEAL_TOKENS tokens, and row 21, healed by the built-in recipe HEAL_RECIPE
and calibrated, run `kvconvert heal` first: minutes on a CPU.)

Every row runs the real commands' code: `kvconvert calibrate` (kvconvert.quant.run) and `kvconvert mla` write the
checkpoints; kvconvert.eval.kv_quant scores them in transformers fp32 with the cache quantize-dequantized as the
serving engine stores it (FP8 / NVFP4: kvconvert.number_formats with the calibrated scales; llama.cpp's types:
kvconvert.ggml_formats in llama.cpp's frame, byte-exact with its CPU backend, Hadamard rotation included), against
the unquantized source on the same windows. With llama-cpp-python installed (scripts/setup_llamacpp.sh), the
llama.cpp rows are scored again by stock llama.cpp itself (kvconvert.engines.llamacpp) on the same windows: the
source's f32 GGUF with an f32 cache as the reference, the row's GGUF with its cache (a 16-bit row: llama.cpp's
default f16 cache, the engine's own reference for the MLA rows' 4-bit cost).

K/V pairs (KTYPE/VTYPE, q5_0/iq4_nl: `-ctk q5_0 -ctv iq4_nl`) are llama.cpp's own mixed caches: stock, as its
flag gives them, and calibrated for the pair (`kvconvert calibrate --kv-dtype q5_0/iq4_nl`), both scored by llama.cpp
on the same bytes; `comparisons` in the JSON holds the calibrated pair's llama.cpp KL against the stock flag's, paired
over windows.

Gate: the default policy's perplexity and KL thresholds (recipes/gates/default.yaml: +5%, 0.05 nats) on the 95%
paired-bootstrap interval over windows, through kvconvert.eval.gate's own verdicts: PASS (the whole interval within),
FAIL (the whole interval past), INCONCLUSIVE (it straddles); the emulation's windows and llama.cpp's each get one.
This table measures the essays only; the quick suite's passkey / NIAH / LongBench are the main job's.

--rows N,M measures those rows and keeps the JSON's other rows (same --windows and --window-len), each row with the
command, commit and date that measured it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench_common import bench_rows, command, parser, publish_rows, run_info, stopwatch, write_json

ESSAY_METRICS = ("perplexity_increase_pct", "kl_mean")  # the default policy's metrics this table measures
HEAL_TOKENS = 8192  # distillation tokens of the healed row (docs/heal.md: 7-30 tokens/s on this 2-core CPU)


@dataclass
class Row:
    name: str  # the table's format column
    kv_dtype: str  # what the cache holds (kvformat name, or a K/V pair KTYPE/VTYPE: kvformat.kv_pair)
    engine: str  # who serves it: "vllm / TensorRT-LLM", "llama.cpp", ...
    model: str  # "source", "mla" (the conversion) or a calibrated folder's name under --work
    calibrate: dict | None = None  # CalibrateOptions of a calibrated row (None: the model as it is)
    rotation: bool = True  # llama.cpp's Hadamard (LLAMA_ATTN_ROT_DISABLE=1 when False)
    what: str = ""  # the model-side rewrites, in words
    commands: list[str] = field(default_factory=list)
    heal_tokens: int = 0  # distillation tokens the model read for this cache (0: not healed)
    heal_recipe: str = ""  # a recipe (built-in name) whose heal makes the model that `calibrate` then calibrates

    @property
    def key(self) -> tuple[str, str, str]:
        """What identifies a row across runs (a rerun replaces the JSON's row of the same key)."""
        return self.name, self.model, self.kv_dtype


def rows_for(mla: str) -> list[Row]:
    src = "smollm2-135m"
    cal = "kvconvert calibrate --src {src} --kv-dtype {kv} --out {out}"
    return [
        Row("FP8 E4M3", "fp8", "vLLM, TensorRT-LLM", "source-fp8", {"kv_dtype": "fp8"}, what="calibrated scales, key phases",
            commands=[cal.format(src=src, kv="fp8", out="source-fp8")]),
        Row("NVFP4", "nvfp4", "TensorRT-LLM", "source-nvfp4", {"kv_dtype": "nvfp4"}, what="calibrated scales, key phases, V Hadamard",
            commands=[cal.format(src=src, kv="nvfp4", out="source-nvfp4")]),
        Row("q8_0", "q8_0", "llama.cpp", "source", what="none (stock `-ctk q8_0 -ctv q8_0`)"),
        Row("q4_0, no rotation", "q4_0", "llama.cpp", "source", rotation=False,
            what="none, LLAMA_ATTN_ROT_DISABLE=1"),
        Row("q4_0", "q4_0", "llama.cpp", "source", what="none (stock `-ctk q4_0 -ctv q4_0`, its Hadamard)"),
        Row("q4_0", "q4_0", "llama.cpp", "source-q4_0", {"kv_dtype": "q4_0"}, what="key pair balance",
            commands=[cal.format(src=src, kv="q4_0", out="source-q4_0")]),
        Row("iq4_nl", "iq4_nl", "llama.cpp", "source", what="none (stock `-ctk iq4_nl -ctv iq4_nl`)"),
        Row("iq4_nl", "iq4_nl", "llama.cpp", "source-iq4_nl", {"kv_dtype": "iq4_nl"}, what="key pair balance",
            commands=[cal.format(src=src, kv="iq4_nl", out="source-iq4_nl")]),
        Row("q5_0", "q5_0", "llama.cpp", "source-q5_0", {"kv_dtype": "q5_0"}, what="key pair balance",
            commands=[cal.format(src=src, kv="q5_0", out="source-q5_0")]),
        Row("MLA 256+64 + FP8", "fp8", "vLLM", "mla-fp8", {"kv_dtype": "fp8"}, what="one-shot MLA, calibrated scales",
            commands=[f"kvconvert mla --src {src} --rank 256 --rope-dim 64 --out mla", cal.format(src="mla", kv="fp8", out="mla-fp8")]),
        Row("MLA 256+64 + q4_0", "q4_0", "llama.cpp", "mla", what="one-shot MLA, no rewrite",
            commands=[f"kvconvert mla --src {src} --rank 256 --rope-dim 64 --out mla"]),
        Row("MLA 256+64 + q4_0", "q4_0", "llama.cpp", "mla-q4_0", {"kv_dtype": "q4_0"},
            what="one-shot MLA, latent shaping",
            commands=[f"kvconvert mla --src {src} --rank 256 --rope-dim 64 --out mla",
                      cal.format(src="mla", kv="q4_0", out="mla-q4_0")]),
        Row("MLA 256+64 + q4_0", "q4_0", "llama.cpp", "mla-q4_0-ks1", {"kv_dtype": "q4_0", "key_strength": 1.0},
            what="one-shot MLA, latent shaping, k_rope pair amax equalization (--key-strength 1)",
            commands=[f"kvconvert mla --src {src} --rank 256 --rope-dim 64 --out mla",
                      cal.format(src="mla", kv="q4_0", out="mla-q4_0-ks1") + " --key-strength 1"]),
        Row("MLA 256+64 + iq4_nl", "iq4_nl", "llama.cpp", "mla-iq4_nl", {"kv_dtype": "iq4_nl", "key_strength": 1.0},
            what="one-shot MLA, latent shaping, k_rope pair amax equalization (--key-strength 1)",
            commands=[f"kvconvert mla --src {src} --rank 256 --rope-dim 64 --out mla",
                      cal.format(src="mla", kv="iq4_nl", out="mla-iq4_nl") + " --key-strength 1"]),
        Row("MLA 256+64, 16-bit", "bf16", "llama.cpp", "mla", what="one-shot MLA, the reference of the MLA rows' "
            "4-bit cost"),
        # K/V pairs (-ctk K -ctv V): bytes per token are the halves' sum (kvmath.kv_bytes_per_token)
        Row("q5_0/iq4_nl", "q5_0/iq4_nl", "llama.cpp", "source", what="none (stock `-ctk q5_0 -ctv iq4_nl`)"),
        Row("q5_0/iq4_nl", "q5_0/iq4_nl", "llama.cpp", "source-q5_0+iq4_nl", {"kv_dtype": "q5_0/iq4_nl"},
            what="key pair balance", commands=[cal.format(src=src, kv="q5_0/iq4_nl", out="source-q5_0+iq4_nl")]),
        Row("iq4_nl/q5_0", "iq4_nl/q5_0", "llama.cpp", "source", what="none (stock `-ctk iq4_nl -ctv q5_0`)"),
        Row("q8_0/iq4_nl", "q8_0/iq4_nl", "llama.cpp", "source", what="none (stock `-ctk q8_0 -ctv iq4_nl`)"),
        Row("q8_0/q4_0", "q8_0/q4_0", "llama.cpp", "source", what="none (stock `-ctk q8_0 -ctv q4_0`)"),
        Row("q5_0/iq4_nl", "q5_0/iq4_nl", "llama.cpp", "healed-q5_0+iq4_nl", heal_tokens=HEAL_TOKENS,
            what="cache-aware healing (`kvconvert heal --recipe distill`), no calibrate",
            commands=["kvconvert " + " ".join(heal_args("q5_0/iq4_nl", HEAL_TOKENS, "SRC", "healed-q5_0+iq4_nl"))]),
        Row("q5_0/iq4_nl", "q5_0/iq4_nl", "llama.cpp", "recipe-healed-q5_0+iq4_nl", {"kv_dtype": "q5_0/iq4_nl"},
            heal_tokens=recipe_heal_tokens(HEAL_RECIPE), heal_recipe=HEAL_RECIPE,
            what=f"cache-aware healing by the built-in recipe {HEAL_RECIPE} (lr 1e-4), then key pair balance",
            commands=[f"kvconvert pipeline --recipe {HEAL_RECIPE} --out OUT (its heal and calibrate stages)"]),
    ]


HEAL_RECIPE = "smollm2-135m-q5_0-iq4_nl-heal"  # the shipped recipe that heals SmolLM2 for its main-job cache


def recipe_heal_tokens(name: str) -> int:
    from kvconvert.recipe import load_recipe

    return load_recipe(name).distill.tokens


def prepare(rows: list[Row], work: Path, mla_calib_tokens: int, threads: int | None = None) -> None:
    """The conversion, each healed and each calibrated folder, through the commands' own code (reused when
    present)."""
    from kvconvert.mla.convert import convert_to_mla
    from kvconvert.mla.options import MLAOptions
    from kvconvert.quant.options import CalibrateOptions
    from kvconvert.quant.run import CalibrateJob, run_calibrate
    from kvconvert.sources import resolve_source

    src = resolve_source("smollm2-135m")
    if any(r.model.startswith("mla") for r in rows) and not (work / "mla" / "manifest.json").is_file():
        convert_to_mla(src, work / "mla", MLAOptions(rank=256, rope_dim=64, calib_tokens=mla_calib_tokens), overwrite=True)
    for row in rows:
        if row.heal_tokens and not (work / row.model / "manifest.json").is_file():
            heal(row, src, work, threads)
        if row.calibrate is None or (work / row.model / "manifest.json").is_file():
            continue
        base = work / "mla" if row.model.startswith("mla") else work / healed_folder(row) if row.heal_recipe else src
        print(f"calibrating {row.model}", file=sys.stderr)
        run_calibrate(CalibrateJob(src=str(base), options=CalibrateOptions(**row.calibrate), out=work / row.model,
                                   overwrite=True), echo=lambda msg: None)


def heal_args(kv_dtype: str, tokens: int, student: str, out: str) -> list[str]:
    """`kvconvert heal`'s arguments for the source healed for its own `kv_dtype` cache on `tokens` distillation
    tokens (the built-in distill preset: attention weights only, docs/heal.md)."""
    return ["heal", "--student", student, "--teacher", "smollm2-135m", "--recipe", "distill", "--distill-kv-dtype",
            kv_dtype, "--distill-tokens", str(tokens), "--out", out]


def healed_folder(row: Row) -> str:
    """Where a recipe-healed row's model goes before its calibration (row.model is the calibrated one)."""
    return f"{row.model}.healed"


def heal(row: Row, src: Path, work: Path, threads: int | None) -> None:
    """`kvconvert heal` itself, in a child process (its log under work), into work/row.model (a recipe's heal: into
    healed_folder, which calibrate then reads)."""
    import subprocess

    cli = Path(sys.executable).with_name("kvconvert")  # the console script beside this python
    if row.heal_recipe:
        if (work / healed_folder(row) / "manifest.json").is_file():
            return
        heal_argv = ["heal", "--student", str(src), "--teacher", "smollm2-135m", "--recipe", row.heal_recipe, "--out",
                     str(work / healed_folder(row))]
    else:
        heal_argv = heal_args(row.kv_dtype, row.heal_tokens, str(src), str(work / row.model))
    args = [str(cli), *heal_argv, "--overwrite", "--no-progress", *(["--threads", str(threads)] if threads else [])]
    print(f"healing {row.model} on {row.heal_tokens} tokens", file=sys.stderr)
    with open(work / f"{row.model}.log", "w") as log:
        subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, check=True)


def model_path(row: Row, work: Path) -> Path:
    from kvconvert.sources import resolve_source

    return resolve_source("smollm2-135m") if row.model == "source" else work / row.model


def hook(row: Row, path: Path):
    from kvconvert.kvformat import kv_pair
    from kvconvert.quant.hooks import fake_quant_hook, llamacpp_hook
    from kvconvert.quant.layout import checkpoint_kv_layout
    from kvconvert.quant.scales import read_kv_scales

    layout = checkpoint_kv_layout(path)
    pair = kv_pair(row.kv_dtype)
    if not pair.quantized:  # a 16-bit row: the cache as computed (fp32 here), no rounding
        return lambda layer, key, value: (key, value)
    if pair.ggml_types:  # llama.cpp's block types, one or a K/V pair
        return llamacpp_hook(layout, row.kv_dtype, rotate=row.rotation)
    return fake_quant_hook(layout, read_kv_scales(path))


def essay_policy():
    """The default policy cut to the metrics the essays measure (its answer likelihoods are the main job's)."""
    from kvconvert.eval.gate import load_policy
    from kvconvert.resources import find_policy

    policy = load_policy(Path(find_policy("default")))
    thresholds = type(policy.thresholds)(**{m: getattr(policy.thresholds, m) for m in ESSAY_METRICS})
    return policy.model_copy(update={"thresholds": thresholds,
                                     "require": [m for m in policy.require if m in ESSAY_METRICS]})


def gate_verdict(records: list[dict]) -> dict:
    """The default policy's perplexity and KL verdicts on window records (kvconvert.eval.metrics.window_stats), by
    kvconvert.eval.gate's own rule: per metric its estimate, 95% paired-bootstrap interval and verdict (PASS /
    FAIL / INCONCLUSIVE); overall the worst of them, and the gate's own summary line."""
    from kvconvert.eval.gate import evaluate, gate_summary

    policy = essay_policy()
    rows = evaluate({"samples": {"perplexity": records}, "suite": {"name": "essays"}}, policy)
    out = {r["metric"]: {"point": r.get("point"), "low": r.get("low"), "high": r.get("high"),
                         "threshold": r["threshold"], "verdict": r["status"].upper(),
                         **({"reason": r["reason"]} if r.get("reason") else {})} for r in rows}
    verdicts = [v["verdict"] for v in out.values()]
    out["verdict"] = next((v for v in ("FAIL", "INCONCLUSIVE") if v in verdicts), "PASS")
    out["summary"] = gate_summary(rows, policy)
    return out


def paired_difference(a: list[dict], b: list[dict]) -> dict:
    """Mean token KL of records `a` minus that of records `b` (the same windows, each against the same
    reference), with the 95% bootstrap interval of the difference, windows resampled together (paired) with
    the default policy's bootstrap settings; negative: `a` is closer to the reference."""
    import numpy as np

    from kvconvert.eval.stats import resample_indices

    settings = essay_policy().bootstrap
    kl_a = np.array([r["kl"] for r in a], dtype=np.float64)
    kl_b = np.array([r["kl"] for r in b], dtype=np.float64)
    n = np.array([r["n_tokens"] for r in a], dtype=np.float64)
    idx = resample_indices(np.zeros(len(n), dtype=np.int64), settings.samples,
                           np.random.default_rng(settings.seed), stratified=False)
    boot = kl_a[idx].sum(1) / n[idx].sum(1) - kl_b[idx].sum(1) / n[idx].sum(1)  # ratio of sums, as kl_mean
    alpha = (1 - settings.confidence) / 2
    low, high = np.quantile(boot, [alpha, 1 - alpha])
    return {"point": float(kl_a.sum() / n.sum() - kl_b.sum() / n.sum()), "low": float(low), "high": float(high),
            "confidence": settings.confidence, "windows": len(n)}


def score_transformers(rows: list[Row], work: Path, windows) -> list[dict]:
    """Per row: window records (kvconvert.eval.metrics.window_stats) against the fp32 source, uncached."""
    import torch

    from kvconvert.eval.metrics import window_stats
    from kvconvert.quant.capture import forward_with_hook, load_hf_model

    ref_model = load_hf_model(model_path(Row("", "bf16", "", "source"), work))
    with torch.no_grad():
        ref = [ref_model(input_ids=w[None], use_cache=False).logits[0] for w in windows]
    models, out = {}, []
    for row in rows:
        path = model_path(row, work)
        model = models.setdefault(path, ref_model if row.model == "source" else load_hf_model(path))
        with stopwatch() as clock, torch.no_grad():
            records = [window_stats(r, forward_with_hook(model, w[None], hook(row, path))[0], w)
                       for r, w in zip(ref, windows)]
        out.append({"records": records, "seconds": clock["seconds"]})
        print(f"{row.name} ({row.what}): scored", file=sys.stderr)
    return out


def score_llamacpp(rows: list[Row], work: Path, windows, threads: int | None) -> tuple[dict[int, dict], float]:
    """Rows in llama.cpp's types (one, or a K/V pair), and 16-bit rows (with llama.cpp's f16 cache, its default),
    scored by stock llama.cpp (GGUF exports under work/gguf):
    ({row index: its result}, the scoring's wall seconds). One llama.cpp worker holds the reference (the
    source's f32 GGUF with an f32 cache, as the emulation's reference is the fp32 source, MLA rows included) and
    a context per row, so each window runs the reference once; per window the same records as the emulation's
    (window_stats), so llama.cpp's numbers get intervals and the gate's verdicts too."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python not installed: the llama.cpp rows are scored by the emulation only "
              "(bash scripts/setup_llamacpp.sh)", file=sys.stderr)
        return {}, 0.0
    from kvconvert.checkpoint.gguf_export import export_gguf
    from kvconvert.engines.gguf_options import GGUFExportOptions
    from kvconvert.engines.llamacpp import LlamaCppContext, LlamaCppScorer
    from kvconvert.kvformat import kv_pair

    ggufs = {}

    def gguf(row: Row) -> Path:
        path = model_path(row, work)
        if path not in ggufs:
            ggufs[path] = work / "gguf" / f"{row.model}.gguf"
            if not ggufs[path].is_file():
                ggufs[path].parent.mkdir(parents=True, exist_ok=True)
                export_gguf(path, ggufs[path], GGUFExportOptions(outtype="f32"), overwrite=True)
        return ggufs[path]

    def cache_types(row: Row) -> tuple[str, str] | None:  # llama.cpp's -ctk / -ctv for the row, None: not served
        pair = kv_pair(row.kv_dtype)
        if pair.ggml_types:
            return pair.ggml_types
        return None if pair.quantized else ("f16", "f16")  # a 16-bit row: llama.cpp's default 16-bit cache

    picked = [i for i, row in enumerate(rows) if cache_types(row)]
    if not picked:
        return {}, 0.0
    contexts = [LlamaCppContext(name="reference", gguf=str(gguf(Row("ref", "fp32", "", "source"))), cache="f32",
                                flash_attn="on")]
    for i in picked:
        k, v = cache_types(rows[i])
        contexts.append(LlamaCppContext(name=f"row{i}", gguf=str(gguf(rows[i])), cache=k, cache_v=v, flash_attn="on",
                                        rotation=rows[i].rotation))
    records: dict[int, list[dict]] = {i: [] for i in picked}
    with stopwatch() as clock, LlamaCppScorer(contexts, n_ctx=len(windows[0]), threads=threads) as engine:
        for w, ids in enumerate(windows):
            sums = engine.score(ids.tolist(), reference="reference")
            for i in picked:
                cand = sums[f"row{i}"]
                records[i].append({"source_nll": sums["reference"].nll, "candidate_nll": cand.nll, "kl": cand.kl,
                                   "n_tokens": cand.tokens, "top1": cand.top1})
            print(f"llama.cpp: window {w + 1} of {len(windows)}", file=sys.stderr)
    out: dict[int, dict] = {}
    for spec, i in zip(contexts[1:], picked):
        gate = gate_verdict(records[i])
        top1 = sum(r["top1"] for r in records[i]) / sum(r["n_tokens"] for r in records[i])
        out[i] = {"kl_mean": gate["kl_mean"]["point"],
                  "perplexity_increase_pct": gate["perplexity_increase_pct"]["point"], "top1_pct": 100 * top1,
                  "cache": f"-ctk {spec.cache} -ctv {spec.type_v}", "reference": "source", "gate": gate,
                  "windows": records[i]}
    print(f"llama.cpp scored {len(picked)} rows in {clock['seconds']:.0f} s", file=sys.stderr)
    return out, clock["seconds"]


def interval_text(gate: dict, fmt: str) -> str:
    """"ppl +x% [lo, hi], KL y [lo, hi]; gate VERDICT" of a gate block (gate_verdict)."""
    ppl, kl = gate["perplexity_increase_pct"], gate["kl_mean"]
    verdict = gate.get("verdict") or ("PASS" if gate["pass"] else "FAIL") + " (its ci_low rule)"  # an older row

    def bounds(m: dict, f: str) -> str:  # too few windows for an interval: none shown
        return "" if m["low"] is None else f" [{m['low']:{f}}, {m['high']:{f}}]"
    return (f"ppl {ppl['point']:+.2f}%{bounds(ppl, '+.2f')}, KL {kl['point']:{fmt}}{bounds(kl, fmt)}; "
            f"gate {verdict}")


def table_row(entry: dict) -> dict:
    """The entry's row of BENCHMARKS.md's kv4bit table, with the command, commit and date that measured it."""
    healed = f", healed on {entry['heal_tokens']:,} tokens" if entry.get("heal_tokens") else ""
    measure = (f"{entry['name']} in {entry['engine']} ({100 * entry['of_bf16']:.1f}% of bf16; "
               f"{entry['what']}{healed}): ppl / KL vs the source, default gate")
    value = interval_text(entry["gate"], ".4f")
    if entry.get("llamacpp"):
        value = f"emulation {value}; llama.cpp itself {interval_text(entry['llamacpp']['gate'], '.4f')}"
    measured = entry["measured"]
    info = {k: measured[k] for k in ("device", "commit", "date")}
    return bench_rows([(measure, value)], info, measured["command"])[0]


def merged(entries: list[dict], json_path: Path | None, windows: int, window_len: int) -> list[dict]:
    """This run's entries and, from an existing JSON measured on the same windows, its rows this run did not
    measure (a row is its name, model and kv_dtype: Row.key), in the table's order (rows_for), older rows
    keeping the command, commit and date that measured them."""
    if json_path is None or not json_path.is_file():
        return entries
    old = json.loads(json_path.read_text())
    if (old.get("windows"), old.get("window_len")) != (windows, window_len):
        print(f"{json_path}: measured on {old.get('windows')} x {old.get('window_len')} windows, not {windows} x "
              f"{window_len}: replaced, not merged", file=sys.stderr)
        return entries
    mine = {(e["name"], e["model"], e["kv_dtype"]) for e in entries}
    run = {k: old[k] for k in ("command", "device", "commit", "date")}  # what measured a row that does not say
    kept = [{"heal_tokens": 0, **e, "measured": e.get("measured") or run}
            for e in old["rows"] if (e["name"], e["model"], e["kv_dtype"]) not in mine]
    order = {row.key: i for i, row in enumerate(rows_for("mla"))}
    return sorted(kept + entries, key=lambda e: order.get((e["name"], e["model"], e["kv_dtype"]), len(order)))


def comparisons(entries: list[dict]) -> list[dict]:
    """Each calibrated llama.cpp row against the stock flag on the same cache (the source, same kv_dtype and
    rotation): KL difference, paired over windows, by the emulation and by llama.cpp itself (paired_difference)."""
    out = []
    stock = {(e["kv_dtype"], e["rotation"]): e for e in entries if e["model"] == "source" and e.get("windows")}
    for e in entries:
        base = stock.get((e["kv_dtype"], e["rotation"]))
        if e["model"] == "source" or e["model"].startswith("mla") or not e.get("windows") or base is None:
            continue
        found = {"kv_dtype": e["kv_dtype"], "row": f"{e['name']}, {e['what']}",
                 "against": f"{base['name']}, {base['what']}",
                 "emulation_kl_difference": paired_difference(e["windows"], base["windows"])}
        if (e.get("llamacpp") or {}).get("windows") and (base.get("llamacpp") or {}).get("windows"):
            found["llamacpp_kl_difference"] = paired_difference(e["llamacpp"]["windows"], base["llamacpp"]["windows"])
        out.append(found)
    return out


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--window-len", type=int, default=1024)
    p.add_argument("--work", type=Path, default=Path("out/bench-kv4bit"))
    p.add_argument("--mla-calib-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--rows", default=None, help="comma-separated row numbers to run (default: all); the JSON's other "
                   "rows measured on the same windows are kept")
    p.add_argument("--no-llamacpp", action="store_true", help="score with the emulation only, not stock llama.cpp "
                   "(scripts/bench_llamacpp.py scores its caches on its own)")
    args = p.parse_args(argv)
    import torch

    from kvconvert.checkpoint import load_tokenizer
    from kvconvert.data import eval_windows
    from kvconvert.kvmath import kv_bytes_per_token
    from kvconvert.quant.layout import checkpoint_kv_layout
    from kvconvert.sources import resolve_source

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = rows_for("mla")
    if args.rows:
        rows = [rows[int(i)] for i in args.rows.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    with stopwatch() as clock:
        prepare(rows, args.work, args.mla_calib_tokens, args.threads)
        src = resolve_source("smollm2-135m")
        windows = eval_windows(load_tokenizer(src), args.windows, args.window_len)
        baseline = kv_bytes_per_token(checkpoint_kv_layout(src), "bf16")
        scored = score_transformers(rows, args.work, list(windows))
        engine, engine_seconds = ({}, 0.0) if args.no_llamacpp else score_llamacpp(rows, args.work, list(windows),
                                                                                    args.threads)
    info = {**run_info(), "command": command()}
    entries = []
    for i, (row, s) in enumerate(zip(rows, scored)):
        kv_bytes = kv_bytes_per_token(checkpoint_kv_layout(model_path(row, args.work)), row.kv_dtype)
        entries.append({"name": row.name, "kv_dtype": row.kv_dtype, "engine": row.engine, "model": row.model,
                        "what": row.what, "rotation": row.rotation, "heal_tokens": row.heal_tokens,
                        "kv_bytes_per_token": kv_bytes, "of_bf16": kv_bytes / baseline,
                        "gate": gate_verdict(s["records"]), "llamacpp": engine.get(i), "commands": row.commands,
                        "seconds": s["seconds"], "windows": s["records"], "measured": info})
    results = merged(entries, args.json, args.windows, args.window_len)
    table = [table_row(e) for e in results]
    payload = {"windows": args.windows, "window_len": args.window_len, "rows": results, **info,
               "seconds": clock["seconds"], "llamacpp_seconds": engine_seconds, "llama_cpp_scored": bool(engine),
               "comparisons": comparisons(results), "bench_rows": {"kv4bit": table}}
    if args.json:
        write_json(args.json, payload)
        publish_rows(payload, args.json)
    for row in table:
        print(f"{row['measure']}\n    {row['value']}")
    for c in payload["comparisons"]:
        for by in ("emulation", "llamacpp"):
            if f"{by}_kl_difference" in c:
                d = c[f"{by}_kl_difference"]
                print(f"{c['row']} vs {c['against']} ({by}): KL {d['point']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]")
    print(f"{clock['seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
