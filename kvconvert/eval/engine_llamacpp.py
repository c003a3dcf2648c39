"""`kvconvert validate --engine llamacpp`: perplexity, KL and top-1 agreement computed by stock llama.cpp.

The suite runs in the bundled runtime as usual (with --kv-dtype q8_0 / q4_0 / ... the runtime emulates
llama.cpp's cache: its block quantizers, kvconvert.kvformat's llama.cpp entries); then source and
candidate are exported to GGUF (kvconvert.checkpoint.gguf_export, into a scratch folder under the report,
removed afterwards) and scored by llama.cpp itself (kvconvert.engines.llamacpp: its C API in a worker
process) on the SAME perplexity windows: the source with its cache as the reference context, the
candidate with its cache, both in one process, KL(source || candidate) summed there per window. Each
window's record is cached like the runtime's. The result goes into report["engines"]["llamacpp"] and a
"Stock llama.cpp" section of report.md, next to the runtime's numbers.

What llama.cpp computes here: only perplexity, KL and top-1 agreement (every window decoded as one
prefill, which in llama.cpp already writes K/V to the cache and attends to the cached, quantized rows).
Weights go into the GGUF as --dtype says (auto: as stored). KV caches: --source-kv-dtype and --kv-dtype
map to llama.cpp's cache types (auto = f16, llama.cpp's default; fp32/fp16/bf16 = f32/f16/bf16; the
llama.cpp formats by their own names), flash attention on whenever a cache is quantized (llama.cpp needs
it for a quantized V), and llama.cpp's Hadamard rotation of quantized caches as LLAMA_ATTN_ROT_DISABLE says
(--llamacpp-rotation / --no-llamacpp-rotation set it for the run, so the runtime's emulation agrees; its MLA
path never rotates: kvconvert.engines.llamacpp).
"""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from kvconvert.errors import KVConvertError
from kvconvert.ggml_formats import rotation_enabled
from kvconvert.kvformat import AUTO, kv_dtype_slug, kv_pair

TASK = "llamacpp_perplexity"
FLOAT_CACHES = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}  # kvconvert's float formats -> llama.cpp's names
WEIGHTS = {"auto": "auto", "fp32": "f32", "fp16": "f16", "bf16": "bf16"}  # --dtype -> export-gguf --outtype


@contextmanager
def llamacpp_rotation(enabled: bool | None):
    """LLAMA_ATTN_ROT_DISABLE for the block: llama.cpp's own rotation switch, which the runtime's emulation of its
    caches and its result fingerprints read too (kvconvert.ggml_formats). None leaves it as it is."""
    from kvconvert.ggml_formats import ROTATION_ENV

    before = os.environ.get(ROTATION_ENV)
    if enabled is not None:
        os.environ[ROTATION_ENV] = "0" if enabled else "1"
    try:
        yield
    finally:
        if enabled is not None:
            if before is None:
                os.environ.pop(ROTATION_ENV, None)
            else:
                os.environ[ROTATION_ENV] = before


def llamacpp_cache(kv_dtype: str, role: str) -> tuple[str, str]:
    """kvconvert's --kv-dtype (a format, or a K/V pair q5_0/iq4_nl) -> llama.cpp's (-ctk, -ctv) type names."""
    from kvconvert.engines.llamacpp import LLAMA_CACHE_TYPES

    if kv_dtype == AUTO:
        return "f16", "f16"
    names = []
    for fmt in (kv_pair(kv_dtype).k, kv_pair(kv_dtype).v):
        name = fmt.ggml_type or FLOAT_CACHES.get(fmt.name)
        if name not in LLAMA_CACHE_TYPES:
            raise KVConvertError(f"--engine llamacpp: the {role}'s KV format {kv_dtype!r} has no llama.cpp cache; "
                                 f"llama.cpp stores {', '.join(LLAMA_CACHE_TYPES)}: pass another --kv-dtype")
        names.append(name)
    return names[0], names[1]


def contexts_for(run, ggufs: dict) -> list:
    """The two llama.cpp contexts: the source (reference) and the candidate, each with its K and V caches
    (-ctk / -ctv), flash attention on when either is quantized (-fa on)."""
    from kvconvert.engines.llamacpp import LlamaCppContext, cache_type

    out = []
    for role, kv in (("source", run.options.source_kv_dtype), ("candidate", run.options.kv_dtype)):
        k, v = llamacpp_cache(kv, role)
        quantized = cache_type(k).quantized or cache_type(v).quantized
        out.append(LlamaCppContext(name=role, gguf=str(ggufs[role]), cache=k, cache_v=v,
                                   flash_attn="on" if quantized else "auto", rotation=rotation_enabled()))
    return out


def cache_flags(context) -> str:
    """A context's cache as llama.cpp's command-line flags (-ctk K -ctv V -fa ...)."""
    return f"-ctk {context.cache} -ctv {context.type_v} -fa {context.flash_attn}"


def rotation_applied(cfg: dict, cache: str, cache_v: str | None = None) -> str:
    """What llama.cpp's Hadamard rotation does to a model's K `cache` and V `cache_v` (llama.cpp's type names; V
    None: as K), as its source decides
    (src/llama-kv-cache.cpp: attn_rot_k / attn_rot_v when the switch is on, the cache type is quantized and the
    head size is a multiple of 64; src/llama-graph.cpp: the MLA path never rotates). The runtime's emulation
    (kvconvert.ggml_formats.llamacpp_frames) follows the same rule."""
    from kvconvert.engines.llamacpp import cache_type
    from kvconvert.ggml_formats import key_rotation_size
    from kvconvert.kvmath import head_dim

    cache_v = cache_v or cache
    k_q, v_q = cache_type(cache).quantized, cache_type(cache_v).quantized
    if not (k_q or v_q):
        return f"none ({cache if cache == cache_v else f'{cache}/{cache_v}'} is not quantized)"
    if not rotation_enabled():
        return "off (LLAMA_ATTN_ROT_DISABLE)"
    if cfg.get("kv_lora_rank"):
        return "none (llama.cpp's MLA path stores the latent unrotated)"
    size = head_dim(cfg)
    if size % 64:
        return f"none (llama.cpp rotates only head sizes that are multiples of 64; this one is {size})"
    turned = [f"K in Hadamard groups of {key_rotation_size(size)}"] * k_q + ["V of 64" if k_q else "V in groups of 64"] * v_q
    return f"on ({', '.join(turned)})"


def check_llamacpp(run) -> None:
    """Before the suite: llama.cpp installed and loading, both caches known, both models exportable (their
    tensors too: a calibrated checkpoint's KV scales are refused here), room under --out for both GGUF exports,
    and each cache one llama.cpp takes for that model's cached rows (from config.json, as the GGUF will declare
    them)."""
    from kvconvert.checkpoint import read_config
    from kvconvert.checkpoint.gguf_export import export_bytes, gguf_arch
    from kvconvert.checkpoint.writer import ensure_free_space
    from kvconvert.engines.llamacpp import GGUFShape, check_context, check_installed
    from kvconvert.kvmath import head_dim
    from kvconvert.sources import resolve_source

    check_installed()
    for role, model in (("source", run.source), ("candidate", run.candidate)):
        cfg = read_config(resolve_source(model))
        arch = gguf_arch(cfg)
        if arch == "deepseek2":
            rank = cfg["kv_lora_rank"]
            shape = GGUFShape(arch, True, rank + cfg["qk_rope_head_dim"], rank, cfg["vocab_size"])
        else:
            shape = GGUFShape(arch, False, head_dim(cfg), head_dim(cfg), cfg["vocab_size"])
        check_context(next(c for c in contexts_for(run, {"source": model, "candidate": model}) if c.name == role),
                      shape)
    paths = {resolve_source(run.source), resolve_source(run.candidate)}  # one export when both are one model
    needed = sum(export_bytes(path, WEIGHTS[run.options.dtype]) for path in paths)
    ensure_free_space(Path(run.out), needed, "free some space or choose another --out (--engine llamacpp exports "
                                             "the models to GGUF under OUT/cache for the run)")


def run_llamacpp_perplexity(run, report: dict, threads: int | None = None) -> dict:
    """Score the suite's perplexity windows with stock llama.cpp; store and return the section."""
    from kvconvert.checkpoint import load_tokenizer, read_config
    from kvconvert.data import data_hash, eval_windows
    from kvconvert.eval.cache import ResultCache
    from kvconvert.eval.runner import runner_fingerprint
    from kvconvert.sources import resolve_source

    spec = run.spec
    if not spec.ppl_windows:
        return _store(report, {"error": f"the {spec.name} suite has no perplexity windows"})
    paths = {"source": resolve_source(run.source), "candidate": resolve_source(run.candidate)}
    outtype = WEIGHTS[run.options.dtype]
    caches = {c.name: c for c in contexts_for(run, paths)}
    windows = eval_windows(load_tokenizer(paths["source"]), spec.ppl_windows, spec.ppl_window_len)
    kv = {"source": run.options.source_kv_dtype, "candidate": run.options.kv_dtype}
    prints = {role: runner_fingerprint(paths[role], "llamacpp", kv[role], "checkpoint") for role in paths}
    cache = ResultCache(Path(run.out) / "cache", resume=run.resume)
    # llama.cpp's settings besides the models and formats: what the cache types, rotation and weights were
    types = {r: c.cache if c.type_v == c.cache else f"{c.cache}/{c.type_v}" for r, c in caches.items()}
    names = {r: kv_dtype_slug(t) for r, t in types.items()}  # the key names a file: K+V for a pair
    key = (f"{prints['source']}-{prints['candidate']}-{names['source']}-{names['candidate']}"
           f"-rot{int(rotation_enabled())}-{outtype}")
    section = {"settings": {"weights": outtype, "kv_cache": types,
                            "flags": {r: cache_flags(c) for r, c in caches.items()},
                            "flash_attn": {r: c.flash_attn for r, c in caches.items()},
                            "rotation": rotation_enabled(), "windows": len(windows),
                            "rotation_applied": {r: rotation_applied(read_config(paths[r]), c.cache, c.type_v)
                                                 for r, c in caches.items()},
                            "window_len": spec.ppl_window_len}, "notes": []}
    records, todo = [], []
    for i, ids in enumerate(windows):
        record = cache.get(key, TASK, f"w{i}", data_hash(ids))
        records.append(record)
        if record is None:
            todo.append(i)
    try:
        if todo:
            _score(run, paths, windows, todo, records, section, threads,
                   lambda i, r: cache.put(key, TASK, f"w{i}", data_hash(windows[i]), r))
    except KVConvertError as exc:  # llama.cpp refused or aborted: report it, keep the runtime's report
        section["error"] = str(exc)
        print(f"note: --engine llamacpp: {exc}", file=sys.stderr)
        return _store(report, section)
    section.update(_summary(records, report))
    for name, value in records[0].get("engine", {}).items():
        section.setdefault(name, value)
    from kvconvert.checkpoint import read_config
    from kvconvert.engines.llamacpp import cache_type

    quantized = cache_type(caches["candidate"].cache).quantized or cache_type(caches["candidate"].type_v).quantized
    if quantized and rotation_enabled() and read_config(paths["candidate"]).get("kv_lora_rank"):
        section["notes"].append("llama.cpp's MLA path stores the latent unrotated: its Hadamard rotation applies "
                                "to per-head K/V caches only (src/llama-graph.cpp)")
    return _store(report, section)


def _score(run, paths: dict, windows, todo: list[int], records: list, section: dict, threads, put) -> None:
    """Export both models to GGUF in a scratch folder, score the windows `todo`, remove the scratch."""
    from kvconvert.checkpoint.gguf_export import export_gguf
    from kvconvert.engines.gguf_options import GGUFExportOptions
    from kvconvert.engines.llamacpp import LlamaCppScorer

    scratch = Path(run.out) / "cache" / "llamacpp-gguf"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        ggufs = {}
        for role in ("source", "candidate"):
            if role == "candidate" and paths["candidate"] == paths["source"]:
                ggufs[role] = ggufs["source"]
                continue
            print(f"llama.cpp: exporting the {role} to GGUF", file=sys.stderr)
            written = export_gguf(paths[role], scratch / f"{role}.gguf",
                                  GGUFExportOptions(outtype=WEIGHTS[run.options.dtype]), name=role)
            ggufs[role] = written.out
        with LlamaCppScorer(contexts_for(run, ggufs), n_ctx=run.spec.ppl_window_len, threads=threads) as engine:
            info = engine.info()
            engine_info = {"llama_cpp_python": info["llama_cpp_python"], "system_info": info["system_info"],
                           "models": {role: c["model"] for role, c in info["contexts"].items()}}  # desc: arch, type
            for n, i in enumerate(todo):
                sums = engine.score(windows[i], reference="source")
                record = {"source_nll": sums["source"].nll, "candidate_nll": sums["candidate"].nll,
                          "kl": sums["candidate"].kl, "top1": sums["candidate"].top1,
                          "n_tokens": sums["candidate"].tokens, "engine": engine_info}
                put(i, record)
                records[i] = record
                print(f"llama.cpp perplexity: window {n + 1}/{len(todo)}", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _summary(records: list[dict], report: dict) -> dict:
    from kvconvert.eval.report import perplexity_summary

    pooled = perplexity_summary(records)
    out = {"perplexity": {k: pooled[k] for k in ("source", "candidate", "delta_pct")}, "kl_mean": pooled["kl_mean"],
           "top1_rate": sum(r["top1"] for r in records) / pooled["tokens"], "tokens": pooled["tokens"]}
    runtime = report.get("metrics", {})
    if "perplexity" in runtime:
        out["bundled"] = {"engine": report["candidate"]["engine"], "kv_dtype": report["candidate"].get("kv_dtype"),
                          "perplexity": {k: runtime["perplexity"][k] for k in ("source", "candidate", "delta_pct")},
                          "kl_mean": runtime["kl_mean"]["candidate"]}
    return out


def _store(report: dict, section: dict) -> dict:
    report.setdefault("engines", {})["llamacpp"] = section
    return section
