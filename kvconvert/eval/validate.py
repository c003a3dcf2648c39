"""`kvconvert validate`: run source and candidate on identical inputs and write a report.

Order of work: build every sample (so missing data fails before any model runs), perplexity +
KL (both models, window by window), then every generation sample with the source, then with the
candidate (one model in memory at a time for those). Each sample's
result is cached under REPORT_DIR/cache as soon as it is done, keyed by (model fingerprint, task,
sample id, content hash): rerunning the same command resumes, and a result computed for a model
is reused by any later report on the same model and samples.
"""

from __future__ import annotations

import datetime as _dt
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvconvert import __version__
from kvconvert.errors import KVConvertError
from kvconvert.eval import haystack, longbench
from kvconvert.eval.cache import ResultCache
from kvconvert.eval.metrics import longbench_sample_score, passkey_score, string_match_all
from kvconvert.eval.runner import LazyRunner, check_same_tokenizer, eos_token_ids, load_tokenizer, resolve_engine
from kvconvert.eval.samples import GenSample
from kvconvert.eval.suites import SUITE_VERSION, SuiteSpec, get_suite

REPORT_FORMAT = 1


@dataclass
class ValidateOptions:
    """Inputs of one validation run (the CLI's options).

    suite: a suite name or a SuiteSpec (programmatic use, tests).
    kv_dtype: the candidate's KV format ("auto" = the engine's unquantized cache);
    source_kv_dtype: the source's (default auto). kv_scales: where the runtime takes fp8/nvfp4
    scales from (checkpoint | dynamic). resume=False recomputes every sample. threads: torch CPU
    threads (None = torch's default; 1 is much faster on a CPU that other jobs share).
    """

    source: str
    candidate: str
    out: Path
    suite: str | SuiteSpec = "quick"
    engine: str | None = None
    kv_dtype: str = "auto"
    source_kv_dtype: str = "auto"
    kv_scales: str = "checkpoint"
    longbench_dir: Path | None = None
    resume: bool = True
    progress: bool = True
    threads: int | None = None
    notes: list[str] = field(default_factory=list)


def note(opts: ValidateOptions, text: str) -> None:
    opts.notes.append(text)
    print(f"note: {text}", file=sys.stderr)


# --------------------------------------------------------------------------- setup

@dataclass
class Pair:
    source: LazyRunner
    candidate: LazyRunner
    tokenizer: object
    context: int
    stop_ids: tuple[int, ...]


def prepare(opts: ValidateOptions) -> Pair:
    from kvconvert.sources import resolve_source

    source_path = resolve_source(opts.source)
    candidate_path = resolve_source(opts.candidate)
    engine = resolve_engine(opts.engine)
    source_tok = load_tokenizer(source_path)
    check_same_tokenizer(source_tok, load_tokenizer(candidate_path), source_path, candidate_path)
    source = LazyRunner(source_path, engine, opts.source_kv_dtype, opts.kv_scales)
    candidate = LazyRunner(candidate_path, engine, opts.kv_dtype, opts.kv_scales)
    if source.vocab_size != candidate.vocab_size:
        raise KVConvertError(f"vocab sizes differ: source {source.vocab_size}, candidate {candidate.vocab_size}; "
                             "logits cannot be compared")
    stop = set(eos_token_ids(source_path))
    if source_tok.eos_token_id is not None:
        stop.add(int(source_tok.eos_token_id))
    return Pair(source, candidate, source_tok, min(source.max_context, candidate.max_context), tuple(sorted(stop)))


# --------------------------------------------------------------------------- perplexity and KL

def window_stats(source_logits: torch.Tensor, candidate_logits: torch.Tensor, ids: torch.Tensor) -> dict:
    """NLL sums and KL sum of one window.

    logits: [T, V] fp32 from each model for ids [T]. Positions 0..T-2 predict ids 1..T-1.
    Returns source_nll / candidate_nll = sum of -log p(next token) and
    kl = sum_t sum_v p_s(v) (log p_s(v) - log p_c(v)), all float64 sums over T-1 positions.
    Identical logits give exactly 0 KL and equal NLLs.
    """
    targets = ids[1:]
    total = {"source_nll": 0.0, "candidate_nll": 0.0, "kl": 0.0}
    for start in range(0, len(targets), 256):  # chunks bound the [chunk, V] temporaries
        rows = slice(start, min(start + 256, len(targets)))
        logp_s = torch.log_softmax(source_logits[rows].double(), dim=-1)
        logp_c = torch.log_softmax(candidate_logits[rows].double(), dim=-1)
        picked = targets[rows].unsqueeze(-1)
        total["source_nll"] -= float(logp_s.gather(-1, picked).sum())
        total["candidate_nll"] -= float(logp_c.gather(-1, picked).sum())
        total["kl"] += float((logp_s.exp() * (logp_s - logp_c)).sum())
    return {**total, "n_tokens": len(targets)}


def run_perplexity(pair: Pair, spec: SuiteSpec, cache: ResultCache, opts: ValidateOptions,
                   skipped: dict[str, str]) -> list[dict]:
    from kvconvert.data import data_hash, eval_windows

    if spec.ppl_window_len > pair.context:
        skipped["perplexity"] = f"windows of {spec.ppl_window_len} tokens exceed the context {pair.context}"
        note(opts, f"perplexity skipped: {skipped['perplexity']}")
        return []
    windows = eval_windows(pair.tokenizer, spec.ppl_windows, spec.ppl_window_len)
    key = f"{pair.source.fingerprint}-{pair.candidate.fingerprint}"
    records = []
    for i in _progress(range(len(windows)), "perplexity + KL", opts):
        ids = windows[i]
        sample_id, content = f"w{i}", data_hash(ids)
        result = cache.get(key, "perplexity", sample_id, content)
        if result is None:
            result = window_stats(pair.source.logits(ids), pair.candidate.logits(ids), ids)
            cache.put(key, "perplexity", sample_id, content, result)
        records.append({"id": sample_id, **result})
    return records


# --------------------------------------------------------------------------- generation samples

def build_samples(pair: Pair, spec: SuiteSpec, opts: ValidateOptions, skipped: dict[str, str]) -> list[GenSample]:
    """Every generation sample of the suite that fits the context; reasons for what is skipped
    are added to `skipped` (task family -> reason)."""
    tok, samples = pair.tokenizer, []

    def fits(length: int, budget: int, what: str) -> bool:
        if length + budget <= pair.context:
            return True
        note(opts, f"{what}: length {length} + {budget} new tokens exceeds the context {pair.context}; dropped")
        return False

    for length in spec.passkey_lengths:
        if fits(length, 16, "passkey"):
            samples += [haystack.passkey_sample(tok, length, d, r, spec.seed)
                        for d in spec.passkey_depths for r in range(spec.passkey_repeats)]
    for length in spec.niah_lengths:
        if fits(length, haystack.NIAH_MAX_NEW, "niah"):
            samples += [haystack.niah_sample(tok, length, d) for d in spec.niah_depths]
    if spec.ruler_tasks:
        for length in spec.ruler_lengths:
            budget = max(min(haystack.RULER_MAX_NEW[t], spec.ruler_max_new or 10**9) for t in spec.ruler_tasks)
            if fits(length, budget, "ruler"):
                samples += [haystack.ruler_sample(tok, task, length, i, spec.seed, spec.ruler_max_new)
                            for task in spec.ruler_tasks for i in range(spec.ruler_samples)]
    else:
        skipped["ruler"] = f"the {spec.name} suite does not run RULER"
    if spec.longbench:
        samples += _longbench_samples(pair, spec, opts, skipped)
    return samples


def _longbench_samples(pair: Pair, spec: SuiteSpec, opts: ValidateOptions, skipped: dict) -> list[GenSample]:
    folder = Path(opts.longbench_dir) if opts.longbench_dir else longbench.default_longbench_dir()
    try:
        rows = longbench.load_longbench(folder, spec.longbench_tasks)
    except KVConvertError as exc:
        if not spec.longbench_optional or folder.exists():
            raise
        skipped["longbench"] = str(exc)
        note(opts, f"LongBench skipped: {exc}")
        return []
    context = min(spec.longbench_context or pair.context, pair.context)
    return longbench.longbench_samples(pair.tokenizer, rows, context, spec.longbench_per_task, spec.longbench_max_new)


def generate_all(runner: LazyRunner, role: str, samples: list[GenSample], pair: Pair, cache: ResultCache,
                 opts: ValidateOptions) -> dict[tuple[str, str], dict]:
    """Greedy outputs of one model for every sample: {(task, id): {"tokens", "text"}}."""
    results = {}
    for sample in _progress(samples, f"{role} generation", opts):
        result = cache.get(runner.fingerprint, sample.task, sample.sample_id, sample.content_hash)
        if result is None:
            ids = torch.tensor(sample.prompt_ids, dtype=torch.long)
            tokens = runner.greedy(ids, sample.max_new_tokens, pair.stop_ids + sample.stop_ids, sample.min_new_tokens)
            result = {"tokens": tokens, "text": pair.tokenizer.decode(tokens, skip_special_tokens=True)}
            cache.put(runner.fingerprint, sample.task, sample.sample_id, sample.content_hash, result)
        results[(sample.task, sample.sample_id)] = result
    return results


def score_sample(sample: GenSample, text: str) -> float:
    """The task's score of one continuation, in [0, 1]."""
    if sample.task == "passkey":
        return passkey_score(text, sample.answers[0])
    if sample.task == "niah" or sample.task.startswith("ruler/"):
        return string_match_all(text, list(sample.answers))
    if sample.task.startswith("longbench/"):
        return longbench_sample_score(sample.meta["task"], text, list(sample.answers), sample.meta.get("all_classes"))
    raise KVConvertError(f"no scorer for task {sample.task!r}")


def _progress(items, label: str, opts: ValidateOptions):
    if not opts.progress:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=label, unit="sample", file=sys.stderr, leave=False, dynamic_ncols=True)


# --------------------------------------------------------------------------- the run

def run_validate(opts: ValidateOptions) -> dict:
    """Run the suite, write report.json / report.md / PNGs into opts.out, return the report."""
    from kvconvert.eval.report import build_report, write_report

    spec = opts.suite if isinstance(opts.suite, SuiteSpec) else get_suite(opts.suite)
    started = time.time()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    pair = prepare(opts)
    if pair.source.fingerprint == pair.candidate.fingerprint:
        note(opts, "source and candidate are the same model with the same engine and KV format"
                   + ("; candidate results are shared with the source through the cache" if opts.resume else ""))
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = ResultCache(out / "cache", resume=opts.resume)
    samples, skipped, phases = run_suite(pair, spec, cache, opts)
    header = {
        "format": REPORT_FORMAT,
        "kvconvert_version": __version__,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "suite": {"name": spec.name, "version": SUITE_VERSION, "spec": spec.as_dict()},
        "source": pair.source.describe(),
        "candidate": pair.candidate.describe(),
        "settings": {"context": pair.context, "stop_ids": list(pair.stop_ids), "resume": opts.resume,
                     "threads": torch.get_num_threads()},
        "cache": {"hits": cache.hits, "misses": cache.misses},
        "seconds": round(time.time() - started, 1),
        "phase_seconds": {k: round(v, 1) for k, v in phases.items()},
        "notes": list(opts.notes),
        "skipped": skipped,
    }
    report = build_report(header, samples)
    write_report(report, out)
    return report


def run_suite(pair: Pair, spec: SuiteSpec, cache: ResultCache, opts: ValidateOptions
              ) -> tuple[dict[str, list[dict]], dict[str, str], dict[str, float]]:
    """Per-sample records by task, skipped task families (with reasons), seconds per phase."""
    samples: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    phases: dict[str, float] = {}
    clock = time.time()

    def lap(name: str) -> None:
        nonlocal clock
        phases[name], clock = time.time() - clock, time.time()

    gen_samples = build_samples(pair, spec, opts, skipped)  # data problems surface before any model runs
    lap("build_samples")
    if spec.ppl_windows:
        samples["perplexity"] = run_perplexity(pair, spec, cache, opts, skipped)
        lap("perplexity")
    outputs = {}
    for role, runner in (("source", pair.source), ("candidate", pair.candidate)):
        outputs[role] = generate_all(runner, role, gen_samples, pair, cache, opts)
        runner.close()
        lap(f"{role}_generation")
    for sample in gen_samples:
        key = (sample.task, sample.sample_id)
        samples.setdefault(sample.task, []).append({
            "id": sample.sample_id, "meta": sample.meta, "answers": list(sample.answers),
            "prompt_tokens": sample.prompt_len, "max_new_tokens": sample.max_new_tokens,
            **{role: {**outputs[role][key], "score": score_sample(sample, outputs[role][key]["text"])}
               for role in ("source", "candidate")},
        })
    return samples, skipped, phases
