"""`kvconvert validate --engine vllm`: perplexity and KL computed by stock vLLM.

The suite itself runs in the bundled runtime as usual; then source and candidate are loaded in
stock vLLM (kvconvert.engines.vllm: a worker in vLLM's own venv) and scored on the SAME
perplexity windows. Per window, vLLM's full fp32 logits for every prompt position are captured
from its own logits processor, so perplexity and KL(source || candidate) use the same formula
as the runtime's numbers (kvconvert.eval.metrics.window_stats). The result goes into
report["engines"]["vllm"] and a "Stock vLLM" section of report.md, next to the runtime's.

What vLLM computes here, and what it does not:
- Only perplexity + KL. Generation tasks (passkey, NIAH, ...) are not rerun in vLLM: on this
  CPU build, MLA decode exists only for latent 576 (512 + 64), so most research shapes cannot
  decode at all; perplexity needs prefill only, which every servable latent runs.
- vLLM scores a whole window in one prefill. Whether prefill attention reads the quantized
  cache depends on the backend; the report says which backend ran.
- Models run in float32 (exact on CPU); the KV cache format follows --kv-dtype /
  --source-kv-dtype (auto -> the model dtype, bf16, fp8, fp8_e5m2). NVFP4 has no vLLM CPU cache.
- vLLM's CPU build truncates K/V into its FP8 cache where GPU engines and the bundled runtime round
  to nearest (kvconvert.engines.vllm.FP8_ROUNDING): with the same scales its FP8 KL is about 4x the
  runtime's. So an FP8 candidate is also scored in transformers with kvconvert's fake-quant set to
  the quantizer vLLM ran ("emulated"): that figure reproduces vLLM's, and the runtime's column stays
  what an RNE engine (vLLM on a GPU) delivers. docs/engines.md has the measurements.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import AUTO, kv_pair

TASK = "vllm_perplexity"
EMULATION_TASK = "vllm_quantizer_emulation"


def vllm_kv_dtype(kv_dtype: str, role: str) -> str:
    """kvconvert's --kv-dtype -> vLLM's kv_cache_dtype (kvconvert.kvformat)."""
    if kv_dtype != AUTO:
        kv_pair(kv_dtype).check_engine("vllm")  # one kv_cache_dtype for K and V: a mixed pair is refused by name
    value = AUTO if kv_dtype == AUTO else kv_pair(kv_dtype).k.vllm_cache_dtype
    if value is None:
        raise KVConvertError(f"--engine vllm: the {role}'s KV format {kv_dtype!r} has no vLLM cache here "
                             "(vLLM has no static INT8 cache; its NVFP4 KV needs a Blackwell GPU and is refused for MLA); "
                             "pass another --kv-dtype")
    return value


def run_vllm_perplexity(run, report: dict, python: str | None = None) -> dict:
    """Score the suite's perplexity windows with stock vLLM; store and return the section."""
    from kvconvert.data import data_hash, eval_windows
    from kvconvert.eval.cache import ResultCache
    from kvconvert.checkpoint import load_tokenizer
    from kvconvert.eval.runner import runner_fingerprint
    from kvconvert.eval.metrics import window_stats
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
                # what vLLM ran, for a rerun that finds every window cached and starts no worker
                result["engine"] = {k: section[k] for k in ("platform", "kv_cache_dtype_loaded")}
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
    for name, value in records[0].get("engine", {}).items():
        section.setdefault(name, value)
    try:
        emulated = _emulate_engine_quantizer(run, paths, kv, windows, section, cache)
    except KVConvertError as exc:  # e.g. scales transformers cannot read: keep vLLM's numbers
        emulated = None
        section["notes"].append(f"vLLM's FP8 quantizer not emulated: {exc}")
    if emulated is not None:
        section["emulated"] = emulated
    return _store(report, section)


def _emulate_engine_quantizer(run, paths: dict, kv: dict, windows, section: dict, cache) -> dict | None:
    """The candidate's FP8 cache with the rounding vLLM's platform really applies, in transformers on
    the same windows (kvconvert.quant's fake-quant), each window's record cached. None where there is
    nothing to emulate (no FP8 candidate, a quantized source, an MLA model whose vLLM scales do not load)."""
    from kvconvert.checkpoint import read_config
    from kvconvert.data import data_hash
    from kvconvert.engines.vllm import FP8_ROUNDING
    from kvconvert.eval.report import perplexity_summary
    from kvconvert.eval.runner import runner_fingerprint

    rounding = FP8_ROUNDING.get(section.get("platform", ""))
    loaded = section.get("kv_cache_dtype_loaded", {})  # what vLLM really stores (auto may turn into fp8)
    fp8 = {role: any(d.startswith("fp8") for d in loaded.get(role) or [kv[role]]) for role in kv}
    if rounding is None or not fp8["candidate"] or fp8["source"] or kv["source"] != "auto":
        return None
    if read_config(paths["candidate"]).get("kv_lora_rank") is not None:
        return None  # MLA: vLLM loads no scale and CPU_MLA prefill skips the cache (section notes)
    prints = [runner_fingerprint(paths["source"], "transformers", "fp32", "checkpoint"),
              runner_fingerprint(paths["candidate"], "transformers", run.options.kv_dtype, "checkpoint")]
    key = f"{prints[0]}-{prints[1]}-{rounding}"
    hashes = [data_hash(ids) for ids in windows]
    records = [cache.get(key, EMULATION_TASK, f"w{i}", content) for i, content in enumerate(hashes)]
    todo = [i for i, r in enumerate(records) if r is None]
    for i, record in _emulated_windows(paths, windows, hashes, todo, rounding, Path(run.out) / "cache"):
        records[i] = record
        cache.put(key, EMULATION_TASK, f"w{i}", hashes[i], record)
    pooled = perplexity_summary(records)
    return {"engine": "transformers", "rounding": rounding, "kv_dtype": run.options.kv_dtype,
            "perplexity": {k: pooled[k] for k in ("source", "candidate", "delta_pct")}, "kl_mean": pooled["kl_mean"],
            "tokens": pooled["tokens"]}


def _emulated_windows(paths: dict, windows, hashes: list[str], todo: list[int], rounding: str, scratch: Path):
    """Yield (i, window_stats record) for the windows `todo`: the source's fp32 logits first (to disk),
    then the candidate with its checkpoint scales and FP8 `rounding`; one model in memory at a time."""
    from contextlib import closing

    from kvconvert.checkpoint import CheckpointReader, read_config
    from kvconvert.eval.runner import TransformersRunner
    from kvconvert.eval.cache import SourceLogits
    from kvconvert.eval.metrics import window_stats
    from kvconvert.quant.capture import forward_with_hook, load_hf_model
    from kvconvert.quant.hooks import fake_quant_hook
    from kvconvert.quant.layout import detect_kv_layout
    from kvconvert.quant.scales import read_kv_scales

    if not todo:
        return
    store = SourceLogits(scratch / "vllm-emulation-source")  # scratch, removed on close
    try:
        with closing(TransformersRunner(paths["source"], kv_dtype="fp32")) as runner:
            for i in todo:
                store.put(hashes[i], runner.logits(windows[i]))
        with CheckpointReader(paths["candidate"], verify=False) as reader:
            layout = detect_kv_layout(read_config(paths["candidate"]), reader.keys())
        hook = fake_quant_hook(layout, read_kv_scales(paths["candidate"]), rounding)
        model = load_hf_model(paths["candidate"])
        for i in todo:
            with torch.inference_mode():
                logits = forward_with_hook(model, windows[i].reshape(1, -1), hook)[0].float()
            yield i, window_stats(store.get(hashes[i]), logits, windows[i])
            print(f"vllm quantizer emulated: window {i + 1}/{len(windows)}", file=sys.stderr)
        del model
    finally:
        store.close()


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
            section.setdefault("platform", info.get("platform"))
            section.setdefault("attention", {})[role] = info["attention"]
            section.setdefault("kv_scales_loaded", {})[role] = _scale_summary(info["kv_scales"])
            loaded = sorted({s["kv_cache_dtype"] for s in info["kv_scales"].values()})
            section.setdefault("kv_cache_dtype_loaded", {})[role] = loaded
            if kv[role] == "auto" and any(d.startswith("fp8") for d in loaded):
                section["notes"].append(f"vLLM stores the {role}'s cache as {'/'.join(loaded)} although auto was "
                                        "asked: its config.json declares a compressed-tensors kv_cache_scheme, which "
                                        "vLLM honours whenever kv_cache_dtype is auto")
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


def write_with_vllm(report: dict, out: Path) -> None:
    """Rewrite report.json / report.md with the vLLM section added (report.md renders it)."""
    from kvconvert.eval.report import write_report

    write_report(report, out)
