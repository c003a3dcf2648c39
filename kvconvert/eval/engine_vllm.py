"""`kvconvert validate --engine vllm`: perplexity and KL computed by stock vLLM.

The suite itself runs in the bundled runtime as usual; then source and candidate are loaded in
stock vLLM (kvconvert.engines.vllm: a worker in vLLM's own venv) and scored on the SAME
perplexity windows. Per window, vLLM's full fp32 logits for every prompt position are captured
from its own logits processor, so perplexity and KL(source || candidate) use the same formula
as the runtime's numbers (kvconvert.eval.validate.window_stats). The result goes into
report["engines"]["vllm"] and a "Stock vLLM" section of report.md, next to the runtime's.

What vLLM computes here, and what it does not:
- Only perplexity + KL. Generation tasks (passkey, NIAH, ...) are not rerun in vLLM: on this
  CPU build, MLA decode exists only for latent 576 (512 + 64), so most research shapes cannot
  decode at all; perplexity needs prefill only, which every servable latent runs.
- vLLM scores a whole window in one prefill. Whether prefill attention reads the quantized
  cache depends on the backend; the report says which backend ran.
- Models run in float32 (exact on CPU); the KV cache format follows --kv-dtype /
  --source-kv-dtype (auto -> the model dtype, bf16, fp8, fp8_e5m2). NVFP4 has no vLLM CPU cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import AUTO, kv_format

TASK = "vllm_perplexity"


def vllm_kv_dtype(kv_dtype: str, role: str) -> str:
    """kvconvert's --kv-dtype -> vLLM's kv_cache_dtype (kvconvert.kvformat)."""
    value = AUTO if kv_dtype == AUTO else kv_format(kv_dtype).vllm_cache_dtype
    if value is None:
        raise KVConvertError(f"--engine vllm: the {role}'s KV format {kv_dtype!r} has no vLLM cache here "
                             "(vLLM's NVFP4 KV needs a Blackwell GPU and is refused for MLA); pass another --kv-dtype")
    return value


def run_vllm_perplexity(run, report: dict, python: str | None = None) -> dict:
    """Score the suite's perplexity windows with stock vLLM; store and return the section."""
    from kvconvert.data import data_hash, eval_windows
    from kvconvert.eval.cache import ResultCache
    from kvconvert.checkpoint import load_tokenizer
    from kvconvert.eval.runner import runner_fingerprint
    from kvconvert.eval.validate import window_stats
    from kvconvert.sources import resolve_source

    spec = run.spec
    if not spec.ppl_windows:
        return _store(report, {"error": f"the {spec.name} suite has no perplexity windows"})
    paths = {"source": resolve_source(run.source), "candidate": resolve_source(run.candidate)}
    kv = {"source": vllm_kv_dtype(run.options.source_kv_dtype, "source"),
          "candidate": vllm_kv_dtype(run.options.kv_dtype, "candidate")}
    windows = eval_windows(load_tokenizer(paths["source"]), spec.ppl_windows, spec.ppl_window_len)
    prints = {role: runner_fingerprint(paths[role], "vllm", kv[role], "checkpoint") for role in paths}
    cache = ResultCache(Path(run.out) / "cache", resume=run.resume)
    key = f"{prints['source']}-{prints['candidate']}"
    section = {"settings": {"dtype": "float32", "kv_cache_dtype": kv, "windows": len(windows),
                            "window_len": spec.ppl_window_len}, "notes": []}
    records, workers = [], {}
    try:
        for i, ids in enumerate(windows):
            content = data_hash(ids)
            result = cache.get(key, TASK, f"w{i}", content)
            if result is None:
                if not workers:
                    workers = _start(paths, kv, spec.ppl_window_len, python, section)
                result = _score_window(workers, ids, window_stats)
                cache.put(key, TASK, f"w{i}", content, result)
            records.append(result)
            print(f"vllm perplexity: window {i + 1}/{len(windows)}", file=sys.stderr)
    except KVConvertError as exc:  # vLLM refused or failed: report it, keep the runtime's report
        section["error"] = str(exc)
        print(f"note: --engine vllm: {exc}", file=sys.stderr)
        return _store(report, section)
    finally:
        for worker in workers.values():
            worker.close()
    section.update(_summary(records, report))
    return _store(report, section)


def _start(paths: dict, kv: dict, window_len: int, python, section: dict) -> dict:
    from kvconvert.engines.vllm import VLLMWorker

    workers = {}
    try:
        for role in ("source", "candidate"):
            worker = VLLMWorker(paths[role], dtype="float32", kv_cache_dtype=kv[role],
                                max_model_len=window_len + 16, python=python).start()  # + the 1 sampled token
            workers[role] = worker
            info = worker.info()
            section.setdefault("vllm_version", info["vllm_version"])
            section.setdefault("attention", {})[role] = info["attention"]
            section.setdefault("kv_scales_loaded", {})[role] = _scale_summary(info["kv_scales"])
    except BaseException:
        for worker in workers.values():
            worker.close()
        raise
    scales = section["kv_scales_loaded"]["candidate"]
    if kv["candidate"].startswith("fp8") and "CPU_MLA" in section["attention"]["candidate"].values():
        section["notes"].append("CPU_MLA prefill attends to fresh K/V, not the fp8 cache (measured: identical "
                                "logprobs with kv_cache_dtype auto): these numbers are the candidate without KV "
                                "quantization; its fp8 decode crashes in vLLM 0.32 on CPU (docs/engines.md)")
    if kv["candidate"].startswith("fp8") and scales["all_one"]:
        section["notes"].append("vLLM loaded no KV scale for the candidate (every layer at 1.0): its fp8 cache "
                                "stores K/V unscaled (vLLM 0.32 attaches no scale to DeepSeek's MLAAttention)")
    return workers


def _scale_summary(scales: dict) -> dict:
    k = [s["k_scale"] for s in scales.values()]
    v = [s["v_scale"] for s in scales.values()]
    return {"layers": len(k), "all_one": all(x == 1.0 for x in k + v),
            "k_min": min(k, default=None), "k_max": max(k, default=None),
            "v_min": min(v, default=None), "v_max": max(v, default=None)}


def _score_window(workers: dict, ids, window_stats) -> dict:
    """window_stats on vLLM's logits, plus the check that those logits are what vLLM scored:
    their log-softmax at the targets must equal vLLM's own prompt logprobs."""
    import torch

    logits, gap = {}, 0.0
    for role, worker in workers.items():
        logprobs, logits[role] = worker.score(ids, logits=True)
        mine = torch.log_softmax(logits[role].double(), -1).gather(-1, ids[1:, None].long())[:, 0]
        gap = max(gap, float((mine - logprobs).abs().max()))
    stats = window_stats(logits["source"], logits["candidate"], ids)
    return {**stats, "logprob_check": gap}


def _summary(records: list[dict], report: dict) -> dict:
    from kvconvert.eval.report import perplexity_summary

    pooled = perplexity_summary(records)
    out = {"perplexity": {k: pooled[k] for k in ("source", "candidate", "delta_pct")}, "kl_mean": pooled["kl_mean"],
           "tokens": pooled["tokens"], "logprob_check_max": max(r["logprob_check"] for r in records)}
    runtime = report.get("metrics", {})
    if "perplexity" in runtime:
        out["bundled"] = {"engine": report["candidate"]["engine"],
                          "perplexity": {k: runtime["perplexity"][k] for k in ("source", "candidate", "delta_pct")},
                          "kl_mean": runtime["kl_mean"]["candidate"]}
    return out


def _store(report: dict, section: dict) -> dict:
    report.setdefault("engines", {})["vllm"] = section
    return section


def markdown_section(report: dict) -> list[str]:
    """Lines for report.md: vLLM's numbers next to the bundled engine's."""
    section = report.get("engines", {}).get("vllm")
    if not section:
        return []
    lines = ["", "## Stock vLLM (same perplexity windows)", ""]
    if "error" in section:
        return lines + [f"Not computed: {section['error']}", ""]
    bundled = section.get("bundled", {})
    engine = bundled.get("engine", "bundled")
    kv = section["settings"]["kv_cache_dtype"]
    lines += [f"vLLM {section.get('vllm_version', '?')}, float32 weights, KV cache source {kv['source']} / "
              f"candidate {kv['candidate']}, attention backend "
              f"{', '.join(sorted(set(section.get('attention', {}).get('candidate', {}).values()))) or '?'}; "
              f"{section['settings']['windows']} x {section['settings']['window_len']} tokens. KL from vLLM's full "
              "logits (captured at its logits processor; their log-softmax matches vLLM's prompt logprobs within "
              f"{section['logprob_check_max']:.1e}).", "",
              f"| metric | vLLM | {engine} |", "|---|---:|---:|"]
    ppl, bundled_ppl = section["perplexity"], bundled.get("perplexity", {})
    rows = [("source perplexity", ppl["source"], bundled_ppl.get("source"), 3),
            ("candidate perplexity", ppl["candidate"], bundled_ppl.get("candidate"), 3),
            ("candidate delta %", ppl["delta_pct"], bundled_ppl.get("delta_pct"), 2),
            ("KL mean (nats/token)", section["kl_mean"], bundled.get("kl_mean"), 5)]
    for name, ours, theirs, digits in rows:
        other = "-" if theirs is None else f"{theirs:.{digits}f}"
        lines.append(f"| {name} | {ours:.{digits}f} | {other} |")
    scales = section.get("kv_scales_loaded", {}).get("candidate")
    if scales and scales["layers"] and kv["candidate"].startswith("fp8"):
        lines += ["", f"KV scales vLLM loaded for the candidate: {scales['layers']} layers, k {scales['k_min']:.4g}.."
                      f"{scales['k_max']:.4g}, v {scales['v_min']:.4g}..{scales['v_max']:.4g}"
                      + (" (all 1.0: none loaded)" if scales["all_one"] else "") + "."]
    lines += [f"- {note}" for note in section["notes"]]
    return lines + [""]


def write_with_vllm(report: dict, out: Path) -> None:
    """Rewrite report.json / report.md with the vLLM section added (report.md renders it)."""
    from kvconvert.eval.report import write_report

    write_report(report, out)
