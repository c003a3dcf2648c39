"""KV caches of SmolLM2-135M by format and engine: bytes, perplexity, KL and the default gate's verdict on the
essays, for the formats vLLM / TensorRT-LLM and llama.cpp serve, with and without kvconvert's model-side rewrites.

    python scripts/bench_kv4bit.py --windows 32 --window-len 1024 --work out/bench-kv4bit --json docs/bench_kv4bit.json

Every row runs the real commands' code: `kvconvert calibrate` (kvconvert.quant.run) and `kvconvert mla` write the
checkpoints; kvconvert.eval.kv_quant scores them in transformers fp32 with the cache quantize-dequantized as the
serving engine stores it (FP8 / NVFP4: kvconvert.number_formats with the calibrated scales; llama.cpp's types:
kvconvert.ggml_formats in llama.cpp's frame, byte-exact with its CPU backend, Hadamard rotation included), against
the unquantized source on the same windows. With llama-cpp-python installed (scripts/setup_llamacpp.sh), the
llama.cpp rows are scored again by stock llama.cpp itself (kvconvert.engines.llamacpp) on the same windows: the
source's f32 GGUF with an f32 cache as the reference, the row's GGUF with its cache.

Gate: the default policy's thresholds for perplexity and KL (recipes/gates/default.yaml: +5%, 0.05 nats) decided on
the low end of the 95% paired-bootstrap interval over windows, as `kvconvert gate` decides (this table measures the
essays only; the quick suite's passkey / NIAH / LongBench are the main job's).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench_common import bench_rows, command, parser, publish_rows, run_info, stopwatch, write_json


@dataclass
class Row:
    name: str  # the table's format column
    kv_dtype: str  # what the cache holds (kvformat name)
    engine: str  # who serves it: "vllm / TensorRT-LLM", "llama.cpp", ...
    model: str  # "source", "mla" (the conversion) or a calibrated folder's name under --work
    calibrate: dict | None = None  # CalibrateOptions of a calibrated row (None: the model as it is)
    rotation: bool = True  # llama.cpp's Hadamard (LLAMA_ATTN_ROT_DISABLE=1 when False)
    what: str = ""  # the model-side rewrites, in words
    commands: list[str] = field(default_factory=list)


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
    ]


def prepare(rows: list[Row], work: Path, mla_calib_tokens: int) -> None:
    """The conversion and each calibrated folder, through the commands' own code (reused when present)."""
    from kvconvert.mla.convert import convert_to_mla
    from kvconvert.mla.options import MLAOptions
    from kvconvert.quant.options import CalibrateOptions
    from kvconvert.quant.run import CalibrateJob, run_calibrate
    from kvconvert.sources import resolve_source

    src = resolve_source("smollm2-135m")
    if any(r.model.startswith("mla") for r in rows) and not (work / "mla" / "manifest.json").is_file():
        convert_to_mla(src, work / "mla", MLAOptions(rank=256, rope_dim=64, calib_tokens=mla_calib_tokens), overwrite=True)
    for row in rows:
        if row.calibrate is None or (work / row.model / "manifest.json").is_file():
            continue
        base = work / "mla" if row.model.startswith("mla") else src
        print(f"calibrating {row.model}", file=sys.stderr)
        run_calibrate(CalibrateJob(src=str(base), options=CalibrateOptions(**row.calibrate), out=work / row.model,
                                   overwrite=True), echo=lambda msg: None)


def model_path(row: Row, work: Path) -> Path:
    from kvconvert.sources import resolve_source

    return resolve_source("smollm2-135m") if row.model == "source" else work / row.model


def hook(row: Row, path: Path):
    from kvconvert.kvformat import kv_format
    from kvconvert.quant.hooks import fake_quant_hook, llamacpp_hook
    from kvconvert.quant.layout import checkpoint_kv_layout
    from kvconvert.quant.scales import read_kv_scales

    layout = checkpoint_kv_layout(path)
    if not kv_format(row.kv_dtype).quantized:  # a 16-bit row: the cache as computed (fp32 here), no rounding
        return lambda layer, key, value: (key, value)
    if kv_format(row.kv_dtype).ggml_type:
        return llamacpp_hook(layout, row.kv_dtype, rotate=row.rotation)
    return fake_quant_hook(layout, read_kv_scales(path))


def gate_verdict(records: list[dict]) -> dict:
    """The default policy's perplexity and KL thresholds on the ci_low of the paired bootstrap over windows."""
    from kvconvert.eval.gate import load_policy
    from kvconvert.eval.stats import estimate
    from kvconvert.resources import find_policy

    policy = load_policy(Path(find_policy("default")))
    out = {}
    for metric in ("perplexity_increase_pct", "kl_mean"):
        est = estimate({"perplexity": records}, metric, n_boot=2000, confidence=0.95, seed=0)
        out[metric] = {"point": est.point, "low": est.low, "high": est.high,
                       "threshold": getattr(policy.thresholds, metric),
                       "pass": est.low <= getattr(policy.thresholds, metric)}
    out["pass"] = all(v["pass"] for v in out.values())
    return out


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


def score_llamacpp(rows: list[Row], work: Path, windows, threads: int | None) -> dict[int, dict]:
    """Rows in llama.cpp's types scored by stock llama.cpp (GGUF exports under work/gguf): {row index: sums}."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python not installed: the llama.cpp rows are scored by the emulation only "
              "(bash scripts/setup_llamacpp.sh)", file=sys.stderr)
        return {}
    from kvconvert.checkpoint.gguf_export import export_gguf
    from kvconvert.engines.gguf_options import GGUFExportOptions
    from kvconvert.engines.llamacpp import LlamaCppContext, LlamaCppScorer
    from kvconvert.kvformat import kv_format
    from kvconvert.token_stats import TokenSums

    ggufs = {}

    def gguf(row: Row) -> Path:
        path = model_path(row, work)
        if path not in ggufs:
            ggufs[path] = work / "gguf" / f"{row.model}.gguf"
            if not ggufs[path].is_file():
                ggufs[path].parent.mkdir(parents=True, exist_ok=True)
                export_gguf(path, ggufs[path], GGUFExportOptions(outtype="f32"), overwrite=True)
        return ggufs[path]

    picked = [i for i, r in enumerate(rows) if kv_format(r.kv_dtype).ggml_type]
    out: dict[int, dict] = {}
    for i in picked:
        row = rows[i]
        ref_row = Row("ref", "fp32", "", "mla" if row.model.startswith("mla") else "source")
        contexts = [LlamaCppContext(name="reference", gguf=str(gguf(ref_row)), cache="f32", flash_attn="on"),
                    LlamaCppContext(name="candidate", gguf=str(gguf(row)), cache=row.kv_dtype, flash_attn="on",
                                    rotation=row.rotation)]
        totals = {}
        with LlamaCppScorer(contexts, n_ctx=len(windows[0]), threads=threads) as engine:
            for ids in windows:
                for name, sums in engine.score(ids.tolist(), reference="reference").items():
                    totals[name] = totals.get(name, TokenSums()) + sums
        ref, cand = totals["reference"], totals["candidate"]
        out[i] = {"ppl": cand.ppl, "ppl_pct": 100 * (cand.ppl / ref.ppl - 1), "kl_mean": cand.kl_mean,
                  "top1_pct": 100 * cand.top1_rate, "reference": ref_row.model}
        print(f"{row.name} ({row.what}): llama.cpp scored", file=sys.stderr)
    return out


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--window-len", type=int, default=1024)
    p.add_argument("--work", type=Path, default=Path("out/bench-kv4bit"))
    p.add_argument("--mla-calib-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--rows", default=None, help="comma-separated row numbers to run (default: all)")
    p.add_argument("--no-llamacpp", action="store_true", help="score with the emulation only, not stock llama.cpp "
                   "(scripts/bench_llamacpp.py scores its caches on its own)")
    args = p.parse_args(argv)
    import torch

    from kvconvert.checkpoint import load_tokenizer
    from kvconvert.data import eval_windows
    from kvconvert.kvformat import kv_format
    from kvconvert.kvmath import kv_bytes_per_token
    from kvconvert.quant.layout import checkpoint_kv_layout
    from kvconvert.sources import resolve_source

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = rows_for("mla")
    if args.rows:
        rows = [rows[int(i)] for i in args.rows.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    prepare(rows, args.work, args.mla_calib_tokens)
    src = resolve_source("smollm2-135m")
    windows = eval_windows(load_tokenizer(src), args.windows, args.window_len)
    baseline = kv_bytes_per_token(checkpoint_kv_layout(src), "bf16")
    scored = score_transformers(rows, args.work, list(windows))
    engine = {} if args.no_llamacpp else score_llamacpp(rows, args.work, list(windows), args.threads)
    results, table = [], []
    for i, (row, s) in enumerate(zip(rows, scored)):
        kv_bytes = kv_bytes_per_token(checkpoint_kv_layout(model_path(row, args.work)), row.kv_dtype)
        gate = gate_verdict(s["records"])
        entry = {"name": row.name, "kv_dtype": row.kv_dtype, "engine": row.engine, "model": row.model, "what": row.what,
                 "rotation": row.rotation, "kv_bytes_per_token": kv_bytes, "of_bf16": kv_bytes / baseline, "gate": gate,
                 "llamacpp": engine.get(i), "commands": row.commands, "seconds": s["seconds"]}
        results.append(entry)
        ppl, kl = gate["perplexity_increase_pct"], gate["kl_mean"]
        measured = (f"ppl {ppl['point']:+.2f}% [{ppl['low']:+.2f}, {ppl['high']:+.2f}], KL {kl['point']:.4f} "
                    f"[{kl['low']:.4f}, {kl['high']:.4f}]")
        if engine.get(i):
            e = engine[i]
            measured += f"; llama.cpp itself: ppl {e['ppl_pct']:+.2f}%, KL {e['kl_mean']:.4f}"
        verdict = "PASS" if gate["pass"] else "FAIL"
        table.append((f"{row.name} in {row.engine} ({100 * kv_bytes / baseline:.1f}% of bf16; {row.what}): "
                      f"ppl / KL vs the source, default gate", f"{measured}; gate {verdict}"))
    info = run_info()
    payload = {"windows": args.windows, "window_len": args.window_len, "rows": results, "command": command(), **info,
               "llama_cpp_scored": bool(engine),
               "bench_rows": {"kv4bit": bench_rows(table, info)}}
    if args.json:
        write_json(args.json, payload)
        publish_rows(payload, args.json)
    for measure, value in table:
        print(f"{measure}\n    {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
