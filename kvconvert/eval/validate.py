"""`kvconvert validate`: run source and candidate on identical inputs and write a report.

Order of work: build every sample (so missing data fails before any model runs) and check that
each model fits in memory; then the source alone: its logits of every perplexity window (kept on
disk under REPORT_DIR/cache, fp32) and its generation samples; the source is freed; then the
candidate alone: its logits of each window against the source's from disk (perplexity + KL) and its
generation samples. One model is in memory at a time, and each is loaded once. Each sample's
result is cached under REPORT_DIR/cache as soon as it is done, keyed by (model fingerprint, task,
sample id, content hash): rerunning the same command resumes, and a result computed for a model
is reused by any later report on the same model and samples.

The source is measured once for every candidate: with `shared` (the CLI and the pipeline pass
source_results_dir(), KVCONVERT_HOME/validate), the source's generation results and its logits of
each essay window are also kept there, keyed by the source runner's fingerprint (checkpoint
content, engine, KV format, weights dtype, device) and each sample's or window's content hash. A
second candidate against the same source, and `kvconvert plan` (same windows, same runner), read
them instead of running the source again; the report counts them as cache hits.
"""

from __future__ import annotations

import datetime as _dt
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvconvert import __version__
from kvconvert.checkpoint import eos_token_ids, load_tokenizer
from kvconvert.errors import KVConvertError
from kvconvert.eval import haystack, longbench
from kvconvert.eval.cache import ResultCache, SourceLogits, SourceResults, source_logits_store, source_results_dir
from kvconvert.eval.metrics import longbench_sample_score, passkey_score, string_match_all, window_stats
from kvconvert.eval.options import SIDE_ENGINES, ValidateOptions
from kvconvert.eval.runner import GENERATION_SEQS, LazyRunner, SampleRequest, check_same_tokenizer, resolve_engine
from kvconvert.eval.samples import EssayWindow, GenSample
from kvconvert.eval.suites import SUITE_VERSION, SuiteSpec, get_suite

REPORT_FORMAT = 1


@dataclass
class ValidateRun:
    """One validation run: the two models, the report folder, the settings (ValidateOptions: the
    CLI's flags and the recipe's `validate` block), the suite they name (or one given directly:
    tests, benchmarks), and the notes the run makes on the way. resume=False recomputes every sample."""

    source: str
    candidate: str
    out: Path
    options: ValidateOptions
    spec: SuiteSpec
    resume: bool = True
    progress: bool = True
    shared: Path | None = None  # source results kept across runs (source_results_dir())
    notes: list[str] = field(default_factory=list)


def note(run: ValidateRun, text: str) -> None:
    run.notes.append(text)
    print(f"note: {text}", file=sys.stderr)


# --------------------------------------------------------------------------- setup

@dataclass
class Pair:
    source: LazyRunner
    candidate: LazyRunner
    tokenizer: object
    context: int
    stop_ids: tuple[int, ...]


def prepare(run: ValidateRun) -> Pair:
    from kvconvert.sources import resolve_source

    source_path = resolve_source(run.source)
    candidate_path = resolve_source(run.candidate)
    engine = resolve_engine("auto" if run.options.engine in SIDE_ENGINES else run.options.engine)
    source_tok = load_tokenizer(source_path)
    check_same_tokenizer(source_tok, load_tokenizer(candidate_path), source_path, candidate_path)
    opts = run.options
    source, candidate = (LazyRunner(path, engine, kv_dtype, opts.kv_scales, opts.dtype, opts.device)
                         for path, kv_dtype in ((source_path, opts.source_kv_dtype), (candidate_path, opts.kv_dtype)))
    if source.vocab_size != candidate.vocab_size:
        raise KVConvertError(f"vocab sizes differ: source {source.vocab_size}, candidate {candidate.vocab_size}; "
                             "logits cannot be compared")
    stop = set(eos_token_ids(source_path))
    if source_tok.eos_token_id is not None:
        stop.add(int(source_tok.eos_token_id))
    return Pair(source, candidate, source_tok, min(source.max_context, candidate.max_context), tuple(sorted(stop)))


# --------------------------------------------------------------------------- perplexity and KL

def perplexity_windows(pair: Pair, spec: SuiteSpec, run: ValidateRun, skipped: dict[str, str]) -> list[EssayWindow]:
    """The suite's essay windows, the long one last, or [] (with the reason in `skipped`). The long window is the
    NIAH prompt of long_window_len tokens (the essays from their start, the needle at the long grid's first depth,
    the question at the end): its first tokens fill the cache and its last ppl_window_len are scored (essay tokens
    past the short windows', so none is scored twice), and the NIAH sample of that length, when the suite runs it,
    reads the window's K/V from the runtime's prefix cache instead of computing them again."""
    from kvconvert.data import eval_windows

    if not spec.ppl_windows:
        return []
    if spec.ppl_window_len > pair.context:
        skipped["perplexity"] = f"windows of {spec.ppl_window_len} tokens exceed the context {pair.context}"
        note(run, f"perplexity skipped: {skipped['perplexity']}")
        return []
    windows = [EssayWindow(ids) for ids in eval_windows(pair.tokenizer, spec.ppl_windows, spec.ppl_window_len)]
    long = spec.long_window_len
    if long and long > pair.context:
        note(run, f"the long perplexity window ({long} tokens) exceeds the context {pair.context}; dropped")
    elif long:
        ids = torch.tensor(haystack.niah_sample(pair.tokenizer, long, spec.long_depths[0]).prompt_ids)
        windows.append(EssayWindow(ids, scored_from=len(ids) - spec.ppl_window_len))
    return windows


def run_perplexity(pair: Pair, windows: list[EssayWindow], role: str, store: SourceLogits, cache: ResultCache,
                   run: ValidateRun) -> list[dict] | None:
    """One model's pass over the windows whose results are not cached yet.

    role "source": keep its logits in `store`. role "candidate": compare with the stored source
    logits and cache each window's result. Returns the per-window records after the candidate pass
    (a long window's record names the tokens its scored ones came after: "context")."""
    key = f"{pair.source.fingerprint}-{pair.candidate.fingerprint}"
    runner = pair.source if role == "source" else pair.candidate
    records = []
    for i in _progress(range(len(windows)), f"{role} perplexity", run):
        w = windows[i]
        sample_id = f"w{i}" if not w.scored_from else f"long{i}"
        result = cache.get(key, "perplexity", sample_id, w.key)
        if result is None and role == "source":
            if store.keep and run.resume and store.has(w.key):  # measured by an earlier run
                store.reused += 1
            else:
                store.put(w.key, runner.logits(w.ids, w.scored_from))
        elif result is None:
            result = window_stats(store.get(w.key), runner.logits(w.ids, w.scored_from), w.ids[w.scored_from:])
            cache.put(key, "perplexity", sample_id, w.key, result)
        records.append({"id": sample_id, **({"context": w.scored_from} if w.scored_from else {}), **(result or {})})
    return records if role == "candidate" else None


# --------------------------------------------------------------------------- generation samples

def build_samples(pair: Pair, spec: SuiteSpec, run: ValidateRun, skipped: dict[str, str]) -> list[GenSample]:
    """Every generation sample of the suite that fits the context; reasons for what is skipped
    are added to `skipped` (task family -> reason)."""
    tok, samples = pair.tokenizer, []

    def fits(length: int, budget: int, what: str) -> bool:
        if length + budget <= pair.context:
            return True
        note(run, f"{what}: length {length} + {budget} new tokens exceeds the context {pair.context}; dropped")
        return False

    for length in spec.passkey_lengths:
        if fits(length, 16, "passkey"):
            samples += [haystack.passkey_sample(tok, length, d, r, spec.seed)
                        for d in spec.passkey_depths for r in range(spec.passkey_repeats)]
    for length in spec.niah_lengths:
        if fits(length, haystack.NIAH_MAX_NEW, "niah"):
            samples += [haystack.niah_sample(tok, length, d) for d in spec.niah_depths]
    for length in spec.long_lengths:  # the sparser grid at long context, both retrieval tasks
        if fits(length, haystack.NIAH_MAX_NEW, "long-context passkey and NIAH"):
            samples += [haystack.passkey_sample(tok, length, d, 0, spec.seed) for d in spec.long_depths]
            samples += [haystack.niah_sample(tok, length, d) for d in spec.long_depths]
    if spec.ruler_tasks:
        for length in spec.ruler_lengths:
            budget = max(haystack.ruler_budget(t, spec.ruler_max_new) for t in spec.ruler_tasks)
            if fits(length, budget, "ruler"):
                samples += [haystack.ruler_sample(tok, task, length, i, spec.seed, spec.ruler_max_new)
                            for task in spec.ruler_tasks for i in range(spec.ruler_samples)]
    else:
        skipped["ruler"] = f"the {spec.name} suite does not run RULER"
    if spec.longbench:
        samples += _longbench_samples(pair, spec, run)
    return samples


def _longbench_samples(pair: Pair, spec: SuiteSpec, run: ValidateRun) -> list[GenSample]:
    rows = longbench.load_longbench(longbench_folder(run.options), spec.longbench_tasks)  # checked in check_inputs
    context = min(spec.longbench_context or pair.context, pair.context)
    return longbench.longbench_samples(pair.tokenizer, rows, context, spec.longbench_per_task, spec.longbench_max_new)


def run_samples(runner: LazyRunner, role: str, samples: list[GenSample], pair: Pair, cache, run: ValidateRun
                ) -> tuple[dict[tuple[str, str], dict], dict[tuple[str, str], dict], int]:
    """One model's greedy output of every sample ({(task, id): {"tokens", "text"}}) and its teacher-forced
    likelihood of each sample's reference answer given the prompt, through this runner's engine and KV cache format
    ({(task, id): {"nll": sum of -log p over the answer tokens, "tokens": n}}). Each is cached under the runner's
    fingerprint (answers under the task "<task>#answer" and the sample's answer_hash); what is not cached runs
    together, GENERATION_SEQS samples at a time, longest first (LazyRunner.run_samples). Also returns how many
    generations the cache's shared part held (the source's results of an earlier run)."""
    outputs, answers = {}, {}
    for sample in samples:
        if (out := cache.get(runner.fingerprint, sample.task, sample.sample_id, sample.content_hash)) is not None:
            outputs[(sample.task, sample.sample_id)] = out
    reused_generations = getattr(cache, "reused", 0)  # read from the shared cache (the source's; see the note)
    for sample in samples:
        if sample.reference_ids and (ans := cache.get(runner.fingerprint, f"{sample.task}#answer", sample.sample_id,
                                                      sample.answer_hash)) is not None:
            answers[(sample.task, sample.sample_id)] = ans
    todo = [s for s in samples if (s.task, s.sample_id) not in outputs
            or (s.reference_ids and (s.task, s.sample_id) not in answers)]

    bar = _progress(None, f"{role} generation and answer likelihood", run, total=len(samples),
                    initial=len(samples) - len(todo))
    pending = [(s, _request(s, pair, generate=(s.task, s.sample_id) not in outputs,
                            score=(s.task, s.sample_id) not in answers)) for s in todo]
    pending.sort(key=lambda p: -p[1].length)  # as the runner groups them: each slice holds samples of similar length
    for start in range(0, len(pending), GENERATION_SEQS):
        batch, requests = zip(*pending[start:start + GENERATION_SEQS])
        for sample, result in zip(batch, runner.run_samples(list(requests))):
            key = (sample.task, sample.sample_id)
            if key not in outputs:
                outputs[key] = {"tokens": result.tokens,
                                "text": pair.tokenizer.decode(result.tokens, skip_special_tokens=True)}
                cache.put(runner.fingerprint, sample.task, sample.sample_id, sample.content_hash, outputs[key])
            if result.answer is not None:
                answers[key] = result.answer
                cache.put(runner.fingerprint, f"{sample.task}#answer", sample.sample_id, sample.answer_hash,
                          result.answer)
        bar.update(len(batch))
    bar.close()
    return outputs, answers, reused_generations


def _request(sample: GenSample, pair: Pair, generate: bool, score: bool) -> SampleRequest:
    """What a sample still needs from a runner: its greedy continuation, its reference answer's likelihood."""
    return SampleRequest(tuple(sample.prompt_ids), sample.max_new_tokens if generate else 0,
                         pair.stop_ids + sample.stop_ids, sample.min_new_tokens,
                         tuple(sample.reference_ids) if score else ())


def score_sample(sample: GenSample, text: str) -> float:
    """The task's score of one continuation, in [0, 1]."""
    if sample.task == "passkey":
        return passkey_score(text, sample.answers[0])
    if sample.task == "niah" or sample.task.startswith("ruler/"):
        return string_match_all(text, list(sample.answers))
    if sample.task.startswith("longbench/"):
        return longbench_sample_score(sample.meta["task"], text, list(sample.answers), sample.meta.get("all_classes"))
    raise KVConvertError(f"no scorer for task {sample.task!r}")


def _progress(items, label: str, run: ValidateRun, **bar):
    from tqdm import tqdm

    return tqdm(items, desc=label, unit="sample", file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=not run.progress, **bar)


# --------------------------------------------------------------------------- the run

def run_validate(source: str, candidate: str, out: Path, options: ValidateOptions | None = None, **kwargs) -> dict:
    """Run the suite (options.suite, or `spec`), write report.json / report.md / PNGs into `out`,
    return the report. threads: torch CPU threads (None = torch's default; 1 is much faster on a
    CPU that other jobs share). With options.engine vllm, stock vLLM (from `vllm_python`, default
    $KVCONVERT_VLLM_PYTHON or ./.venv-vllm) also scores the perplexity windows, beside the runtime; with
    llamacpp, stock llama.cpp. shared: the folder of source results kept across runs (source_results_dir();
    None: this report only). options.llamacpp_rotation, when given, is llama.cpp's rotation switch for the whole
    run (the runtime's emulation of llama.cpp's caches and llama.cpp itself read the same variable)."""
    from kvconvert.eval.engine_llamacpp import llamacpp_rotation

    options = options or ValidateOptions()
    with llamacpp_rotation(options.llamacpp_rotation):
        return _run_validate(source, candidate, out, options, **kwargs)


def _run_validate(source: str, candidate: str, out: Path, options: ValidateOptions, *,
                  spec: SuiteSpec | None = None, resume: bool = True, progress: bool = True, threads: int | None = None,
                  vllm_python: str | None = None, shared: Path | None = None) -> dict:
    from kvconvert.eval.report import build_report, write_report

    run = ValidateRun(source, candidate, Path(out), options, spec or get_suite(options.suite), resume, progress,
                      shared=Path(shared) if shared is not None else None)
    check_inputs(run, vllm_python)
    started = time.time()
    if threads:
        torch.set_num_threads(threads)
    pair = prepare(run)
    if pair.source.fingerprint == pair.candidate.fingerprint:
        note(run, "source and candidate are the same model with the same engine and KV format"
                  + ("; candidate results are shared with the source through the cache" if run.resume else ""))
    run.out.mkdir(parents=True, exist_ok=True)
    cache = ResultCache(run.out / "cache", resume=run.resume)
    samples, skipped, phases = run_suite(pair, run.spec, cache, run)
    header = {
        "format": REPORT_FORMAT,
        "kvconvert_version": __version__,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "suite": {"name": run.spec.name, "version": SUITE_VERSION, "spec": run.spec.as_dict()},
        "source": pair.source.describe(),
        "candidate": pair.candidate.describe(),
        "settings": {"context": pair.context, "stop_ids": list(pair.stop_ids), "resume": run.resume,
                     "threads": torch.get_num_threads()},
        "cache": {"hits": cache.hits, "misses": cache.misses, "shared": str(run.shared) if run.shared else None},
        "seconds": round(time.time() - started, 1),
        "phase_seconds": {k: round(v, 1) for k, v in phases.items()},
        "notes": list(run.notes),
        "skipped": skipped,
    }
    report = build_report(header, samples)
    if options.engine in STOCK_ENGINES:  # asked for: recorded before its phase, so a run killed in it says so
        report.setdefault("engines", {})[options.engine] = {
            "pending": f"validate --engine {options.engine} was asked for and its phase did not finish (interrupted "
                       "or killed); rerun validate with the same --out to finish it"}
    write_report(report, run.out)
    if options.engine == "vllm":
        _add_vllm(run, report, vllm_python)
    if options.engine == "llamacpp":
        _add_llamacpp(run, report, threads)
    return report


STOCK_ENGINES = ("vllm", "llamacpp")  # engines whose results go into report["engines"], beside the runtime's


def _add_llamacpp(run: ValidateRun, report: dict, threads: int | None) -> None:
    """Stock llama.cpp's section of the report (--engine llamacpp); a failure is recorded and raised as for vLLM."""
    from kvconvert.eval.engine_llamacpp import run_llamacpp_perplexity
    from kvconvert.eval.report import write_report

    section = run_llamacpp_perplexity(run, report, threads)
    if "error" in section:
        report["notes"].append(f"--engine llamacpp failed: {section['error']}")
    write_report(report, run.out)
    if "error" in section:
        reason = " ".join(section["error"].split())
        raise KVConvertError(f"--engine llamacpp failed, no llama.cpp numbers (the bundled runtime's are in "
                             f"{run.out / 'report.json'}, which records the failure): {reason}")


def _add_vllm(run: ValidateRun, report: dict, vllm_python: str | None) -> None:
    """Stock vLLM's section of the report (--engine vllm). An engine asked for by name that cannot score the
    models is a failure, not a footnote: report.json records it (engines.vllm.error, a note) and the run
    raises, so the command exits 2 with vLLM's reason instead of 0 with the runtime's numbers alone."""
    from kvconvert.eval.engine_vllm import run_vllm_perplexity, write_with_vllm

    section = run_vllm_perplexity(run, report, vllm_python)
    if "error" in section:
        report["notes"].append(f"--engine vllm failed: {section['error']}")
    write_with_vllm(report, run.out)
    if "error" in section:
        reason = " ".join(section["error"].split())  # vLLM's worker adds its log's last line: one line here
        raise KVConvertError(f"--engine vllm failed, no vLLM numbers (the bundled runtime's are in "
                             f"{run.out / 'report.json'}, which records the failure): {reason}")


def check_inputs(run: ValidateRun, vllm_python: str | None) -> None:
    """Up-front checks, before hours of suite work: vLLM present and serving both KV formats
    (--engine vllm), the report folder writable, both models supported and intact."""
    from kvconvert.checkpoint import check_checkpoint, check_writable
    from kvconvert.sources import resolve_source

    if run.options.engine == "vllm":
        from kvconvert.engines.vllm import check_vllm_installed, vllm_python as find_vllm_python
        from kvconvert.eval.engine_vllm import vllm_kv_dtype

        check_vllm_installed(find_vllm_python(vllm_python))  # before the suite: a python without vLLM is refused
        vllm_kv_dtype(run.options.kv_dtype, "candidate")
        vllm_kv_dtype(run.options.source_kv_dtype, "source")
        for role, model in (("source", run.source), ("candidate", run.candidate)):
            _check_vllm_serves(role, resolve_source(model))
    elif vllm_python:
        raise KVConvertError("--vllm-python goes with --engine vllm")
    if run.options.engine == "llamacpp":
        from kvconvert.eval.engine_llamacpp import check_llamacpp

        check_llamacpp(run)  # installed, both caches llama.cpp's, both models exportable: before the suite
    if run.spec.longbench:  # a folder given and missing is refused like an empty one, before any model loads
        longbench.longbench_files(longbench_folder(run.options), run.spec.longbench_tasks)
    check_writable(run.out)
    for model in (run.source, run.candidate):
        check_checkpoint(resolve_source(model))


def _check_vllm_serves(role: str, path: Path) -> None:
    """Refuse an MLA shape stock vLLM refuses at load (kvconvert.targets), before the suite runs."""
    from kvconvert.checkpoint import read_config
    from kvconvert.targets import TARGETS

    cfg = read_config(path)
    rank, rope = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if rank is not None and rope is not None and not TARGETS["vllm"].serves(rank, rope):
        raise KVConvertError(f"--engine vllm: the {role} {path} caches an MLA latent of {rank}+{rope} = {rank + rope} "
                             f"values, which vLLM refuses ({TARGETS['vllm'].note}); validate it without --engine "
                             "vllm, or convert it with `kvconvert mla --target vllm`")


def longbench_folder(options: ValidateOptions) -> Path:
    """--longbench-dir, else $KVCONVERT_LONGBENCH_DIR, else the LongBench-mini copy kvconvert ships."""
    return Path(options.longbench_dir) if options.longbench_dir else longbench.default_longbench_dir()


def run_suite(pair: Pair, spec: SuiteSpec, cache: ResultCache, run: ValidateRun
              ) -> tuple[dict[str, list[dict]], dict[str, str], dict[str, float]]:
    """Per-sample records by task, skipped task families (with reasons), seconds per phase.
    The source runs everything first and is freed, then the candidate (see the module docstring)."""
    samples: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    phases: dict[str, float] = {}
    clock = time.time()

    def lap(name: str) -> None:
        nonlocal clock
        phases[name], clock = time.time() - clock, time.time()

    gen_samples = build_samples(pair, spec, run, skipped)  # data problems surface before any model runs
    windows = perplexity_windows(pair, spec, run, skipped)
    size_runners(pair, windows, gen_samples)
    lap("build_samples")
    outputs, answers = {}, {}
    store = source_logits_store(pair.source, windows, run.shared if run.resume else None,
                                Path(run.out) / "cache" / f"source-logits-{pair.source.fingerprint}",
                                say=lambda text: note(run, text))
    shared = None
    if run.shared is not None:
        try:
            shared = ResultCache(run.shared / "cache", resume=run.resume,
                                 fix="free space there or point KVCONVERT_HOME (the source's results kept across "
                                     "runs) at a disk with room")
        except (KVConvertError, OSError) as exc:  # e.g. a read-only KVCONVERT_HOME: not kept, still measured
            note(run, f"the source's results are not kept across runs: {exc}")
    caches = {"source": SourceResults(cache, shared), "candidate": cache}
    try:
        for role, runner in (("source", pair.source), ("candidate", pair.candidate)):
            if windows:
                records = run_perplexity(pair, windows, role, store, cache, run)
                if records is not None:
                    samples["perplexity"] = records
                lap(f"{role}_perplexity")
            outputs[role], answers[role], generated = run_samples(runner, role, gen_samples, pair, caches[role], run)
            if role == "source" and (store.reused or caches["source"].reused):
                note(run, f"the source's results of {store.reused} essay windows, {generated} samples and "
                          f"{caches['source'].reused - generated} answer likelihoods were measured by an earlier run "
                          f"(kept in {run.shared}), not recomputed")
            runner.close()
            lap(f"{role}_generation")
    finally:
        store.close()
    for sample in gen_samples:
        key = (sample.task, sample.sample_id)
        samples.setdefault(sample.task, []).append({
            "id": sample.sample_id, "meta": sample.meta, "answers": list(sample.answers),
            "prompt_tokens": sample.prompt_len, "max_new_tokens": sample.max_new_tokens,
            **{role: {**outputs[role][key], "score": score_sample(sample, outputs[role][key]["text"]),
                      **answer_fields(answers[role].get(key))}
               for role in ("source", "candidate")},
        })
    return samples, skipped, phases


def answer_fields(result: dict | None) -> dict:
    """A record's answer likelihood: answer_nll (mean nats per reference token) and answer_tokens; {} without."""
    if result is None:
        return {}
    return {"answer_nll": result["nll"] / result["tokens"], "answer_tokens": result["tokens"]}


def size_runners(pair: Pair, windows: list, gen_samples: list[GenSample]) -> None:
    """Give both runners the longest sequence this run needs (their KV pools are sized to it, not
    to the model's whole context) and refuse up front when either model cannot fit alone."""
    lengths = [len(w) for w in windows] + [s.prompt_len + s.max_new_tokens for s in gen_samples]
    for role, runner in (("source", pair.source), ("candidate", pair.candidate)):
        runner.max_len = max(lengths, default=runner.max_context)
        runner.check_memory(role)
