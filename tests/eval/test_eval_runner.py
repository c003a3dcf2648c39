"""Model runners on a tiny random Llama: logits, greedy decoding, fingerprints, engine checks."""

import dataclasses
import hashlib
import json
import shutil

import pytest
import torch
from eval_fixtures import save_tiny_model, train_tokenizer

from kvconvert.checkpoint import estimate_checkpoint_bytes, load_tokenizer
from kvconvert.data import eval_windows
from kvconvert.errors import KVConvertError
from kvconvert.eval import haystack
from kvconvert.eval import runner as R
from kvconvert.eval.suites import SUITES
from kvconvert.eval.validate import ValidateOptions, run_validate, window_stats


@pytest.fixture(scope="module")
def hf_runner(tiny_llama):
    return R.TransformersRunner(tiny_llama)


def test_transformers_logits_match_plain_forward(hf_runner, tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ids = torch.arange(3, 40)
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
    got = hf_runner.logits(ids)
    assert got.shape == (37, hf_runner.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_greedy_equals_argmax_of_full_recompute_and_stops_before_a_stop_token(hf_runner):
    """The cached decode loop must pick what a from-scratch forward would pick at every step."""
    ids = torch.arange(5, 25)
    tokens = hf_runner.greedy(ids, 12, stop_ids=())
    assert len(tokens) == 12
    seq = ids.clone()
    for token in tokens:
        assert int(hf_runner.logits(seq)[-1].argmax()) == token
        seq = torch.cat([seq, torch.tensor([token])])
    cut = hf_runner.greedy(ids, 12, stop_ids=(tokens[3],))
    assert cut == tokens[:tokens.index(tokens[3])]
    assert hf_runner.greedy(ids, 0, ()) == []


def test_min_new_tokens_masks_stop_ids_at_first_steps(hf_runner):
    ids = torch.arange(5, 25)
    first = hf_runner.greedy(ids, 1, ())[0]
    assert hf_runner.greedy(ids, 5, (first,)) == []  # the stop token would end it at once
    forced = hf_runner.greedy(ids, 5, (first,), min_new_tokens=1)
    logits = hf_runner.logits(ids)[-1].clone()
    logits[first] = float("-inf")
    assert forced and forced[0] == int(logits.argmax())  # the best token that is not a stop id


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_runtime_runner_matches_transformers_with_fp32_kv(arch, tmp_path, tiny_llama, tiny_tokenizer_dir,
                                                          tiny_tokenizer):
    """Both engines, K/V in fp32: the same logits and greedy tokens (with and without min_new_tokens),
    for a Llama and for a stock DeepSeek-V3 (MLA) checkpoint, what `kvconvert mla` writes."""
    folder = tiny_llama if arch == "llama" else save_tiny_model(tmp_path / "dsv3", len(tiny_tokenizer),
                                                                 tokenizer_dir=tiny_tokenizer_dir, arch=arch)
    hf, runtime = R.TransformersRunner(folder), R.RuntimeRunner(folder, "fp32")
    ids = torch.arange(3, 100)
    logits = hf.logits(ids)
    assert logits.shape == (97, len(tiny_tokenizer))
    torch.testing.assert_close(runtime.logits(ids), logits, rtol=1e-4, atol=1e-4)
    assert runtime.greedy(ids, 8, (0,)) == hf.greedy(ids, 8, (0,))
    first = hf.greedy(ids, 1, ())[0]
    assert runtime.greedy(ids, 6, (first,), min_new_tokens=1) == hf.greedy(ids, 6, (first,), min_new_tokens=1)
    assert runtime.fingerprint != hf.fingerprint  # engine is part of the key


def test_quantized_kv_without_scales_is_refused_before_loading(tiny_llama):
    with pytest.raises(KVConvertError, match="needs KV scales.*kvconvert calibrate"):
        R.LazyRunner(tiny_llama, "transformers", "fp8")
    with pytest.raises(KVConvertError, match="--kv-scales dynamic"):
        R.LazyRunner(tiny_llama, "runtime", "nvfp4")
    with pytest.raises(KVConvertError, match="unknown"):
        R.resolve_kv_dtype("runtime", "int4")


def test_fake_quant_kv_in_transformers_matches_the_runtime_bit_for_bit(calibrated_fp8):
    """Both engines quantize the cached K/V with the same scales (bit-exact formats), so an FP8 KV
    candidate scores the same whichever engine runs it; and FP8 really changes the logits."""
    ids = torch.arange(3, 200)
    hf_fp8 = R.TransformersRunner(calibrated_fp8, "fp8")
    runtime_fp8 = R.RuntimeRunner(calibrated_fp8, "fp8")
    fp8_logits = hf_fp8.logits(ids)
    torch.testing.assert_close(fp8_logits, runtime_fp8.logits(ids), rtol=1e-5, atol=1e-5)
    assert hf_fp8.greedy(ids, 8, (0,)) == runtime_fp8.greedy(ids, 8, (0,))
    exact = R.TransformersRunner(calibrated_fp8, "fp32").logits(ids)
    assert (fp8_logits - exact).abs().max() > 1e-4
    bf16 = R.TransformersRunner(calibrated_fp8, "bf16").logits(ids)
    torch.testing.assert_close(bf16, R.RuntimeRunner(calibrated_fp8, "bf16").logits(ids), rtol=1e-5, atol=1e-5)


def test_fingerprint_follows_content_engine_and_kv(tmp_path, tiny_llama, tiny_tokenizer):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama, copy)  # copy2 keeps sizes and mtimes: same weights, same fingerprint
    assert R.checkpoint_fingerprint(copy) == R.checkpoint_fingerprint(tiny_llama)
    other = save_tiny_model(tmp_path / "other", len(tiny_tokenizer), seed=1)
    assert R.checkpoint_fingerprint(other) != R.checkpoint_fingerprint(tiny_llama)
    base = R.runner_fingerprint(tiny_llama, "runtime", "bf16", "checkpoint")
    assert base != R.runner_fingerprint(tiny_llama, "runtime", "fp8", "checkpoint")
    assert R.runner_fingerprint(tiny_llama, "runtime", "fp8", "checkpoint") != R.runner_fingerprint(
        tiny_llama, "runtime", "fp8", "dynamic")
    assert base != R.runner_fingerprint(tiny_llama, "transformers", "bf16", "checkpoint")
    assert base != R.runner_fingerprint(tiny_llama, "runtime", "bf16", "checkpoint", device="cuda")
    # fp32 checkpoints keep the fingerprints (and cached results) they had before --dtype
    old = hashlib.sha256(f"{R.checkpoint_fingerprint(tiny_llama)}|runtime|kv=bf16".encode()).hexdigest()[:16]
    assert R.LazyRunner(tiny_llama, "runtime").fingerprint == old


def test_manifest_fingerprint_ignores_creation_time_but_not_stale_manifests(tmp_path):
    for name, created in (("a", "2025-01-01"), ("b", "2026-01-01")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"0123")
        files = {"config.json": {"sha256": "c0", "bytes": 2}, "model.safetensors": {"sha256": "w0", "bytes": 4}}
        (folder / "manifest.json").write_text(json.dumps({"created": created, "files": files}))
    assert R.checkpoint_fingerprint(tmp_path / "a") == R.checkpoint_fingerprint(tmp_path / "b")
    before = R.checkpoint_fingerprint(tmp_path / "a")
    (tmp_path / "a" / "model.safetensors").write_bytes(b"012345")  # edited without updating the manifest
    assert R.checkpoint_fingerprint(tmp_path / "a") != before


def test_different_tokenizers_are_refused(tmp_path, tiny_tokenizer_dir, tiny_tokenizer):
    other = train_tokenizer(tmp_path / "other", vocab_size=400)
    with pytest.raises(KVConvertError, match="tokenizers differ.*tokens"):
        R.check_same_tokenizer(tiny_tokenizer, other, tiny_tokenizer_dir, tmp_path / "other")
    same_size = train_tokenizer(tmp_path / "shifted", vocab_size=512, chars=150_000)
    with pytest.raises(KVConvertError, match="probe string"):
        R.check_same_tokenizer(tiny_tokenizer, same_size, tiny_tokenizer_dir, tmp_path / "shifted")
    R.check_same_tokenizer(tiny_tokenizer, load_tokenizer(tiny_tokenizer_dir), tiny_tokenizer_dir, tiny_tokenizer_dir)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(KVConvertError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_engine_resolution():
    assert R.resolve_engine("transformers") == "transformers"
    with pytest.raises(KVConvertError, match="unknown"):
        R.resolve_engine("vllm")
    expected = "runtime" if R.runtime_available() is None else "transformers"
    assert R.resolve_engine("auto") == expected


# --------------------------------------------------------------------------- bounded memory

@pytest.fixture(scope="module")
def bf16_llama(tiny_llama, tmp_path_factory):
    """The tiny Llama re-stored in bf16, as real checkpoints ship (tokenizer files kept)."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_llama, tmp_path_factory.mktemp("bf16") / "llama")
    for f in folder.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    return folder


def test_bf16_checkpoints_run_in_fp32_without_native_bf16_and_in_bf16_on_request(bf16_llama, monkeypatch):
    """dtype auto on the CPU: bf16 weights stay bf16 where the CPU has native bf16, and are upcast to fp32
    (exact) where it has not (AVX2), unless that copy would take more than half the available memory. Asked for
    bf16, both engines compute in bf16 from the same weights; their fp32 logits agree to bf16 rounding of the
    activations (measured max |d| ~0.03 at logit std ~0.5), and the fp32 run agrees with them to that rounding."""
    ids = torch.arange(3, 60)
    hf = R.TransformersRunner(bf16_llama, "bf16", dtype="bf16")
    rt = R.RuntimeRunner(bf16_llama, "bf16", dtype="bf16")
    assert hf.dtype == rt.dtype == torch.bfloat16
    assert next(hf.model.parameters()).dtype == torch.bfloat16 and rt.llm.model.dtype == torch.bfloat16
    a, b = hf.logits(ids), rt.logits(ids)
    assert a.dtype == b.dtype == torch.float32
    assert float((a - b).abs().max()) < 0.25 * float(a.std())
    fp32 = R.RuntimeRunner(bf16_llama, "bf16", dtype="fp32")
    assert fp32.llm.model.dtype == torch.float32 and fp32.fingerprint != rt.fingerprint
    assert float((fp32.logits(ids) - b).abs().max()) < 0.25 * float(a.std())
    cpu = torch.device("cpu")
    auto = R.RuntimeRunner(bf16_llama, "bf16")  # this machine's choice
    assert auto.dtype == (torch.bfloat16 if R.cpu_kind().native_bf16 else torch.float32)
    choose = lambda native: R.compute_dtype("auto", torch.bfloat16, bf16_llama, cpu, native_bf16=native)
    assert (choose(True), choose(False)) == (torch.bfloat16, torch.float32)
    assert R.compute_dtype("bf16", torch.bfloat16, bf16_llama, cpu, native_bf16=False) == torch.bfloat16  # as asked
    fp32_bytes = estimate_checkpoint_bytes(bf16_llama, itemsize=4)
    monkeypatch.setenv("KVCONVERT_AVAILABLE_MEMORY", str(2 * fp32_bytes - 1))  # the fp32 copy would not fit
    assert choose(False) == torch.bfloat16
    monkeypatch.setenv("KVCONVERT_AVAILABLE_MEMORY", str(2 * fp32_bytes))
    assert choose(False) == torch.float32


def test_cpu_kind_names_the_vector_units_torch_uses():
    """The kind follows torch's kernel level (which ATEN_CPU_CAPABILITY lowers), named from /proc/cpuinfo."""
    kind = R.cpu_kind()
    capability = torch.backends.cpu.get_cpu_capability()
    assert kind.capability == capability
    assert kind.name == {"AVX512": "AMX" if "amx_bf16" in kind.flags else "AVX-512", "AVX2": "AVX2"}.get(capability,
                                                                                                         "other")
    assert not kind.native_bf16 or kind.name in ("AMX", "AVX-512")
    assert kind.name in kind.describe() and capability in kind.describe()


def test_validate_holds_one_model_at_a_time_and_matches_direct_metrics(tmp_path, tiny_llama, calibrated_fp8,
                                                                        tiny_tokenizer, monkeypatch):
    """Source and candidate are never loaded together (the source's window logits wait on disk),
    each loads once, and the perplexity/KL records equal window_stats on directly computed logits.
    The candidate is FP8 KV (calibrated scales) against the fp32-KV source: the runtime stores the
    cache in FP8, transformers fake-quantizes it bit-exactly, so both engines report the same KL."""
    loads, resident, live = [], [], set()
    for engine, cls in list(R.RUNNERS.items()):
        class Tracked(cls):
            def __init__(self, path, *args, **kw):
                super().__init__(path, *args, **kw)
                live.add(self.path)
                loads.append(self.path)
                resident.append(len(live))

            def close(self):
                live.discard(self.path)
                super().close()
        monkeypatch.setitem(R.RUNNERS, engine, Tracked)
    spec = dataclasses.replace(SUITES["smoke"], name="seq", ppl_windows=3, passkey_lengths=(512,), niah_lengths=(),
                               ruler_tasks=(), longbench=False)
    kl = {}
    for engine in ("runtime", "transformers"):
        loads.clear()
        resident.clear()
        out = tmp_path / engine
        report = run_validate(str(tiny_llama), str(calibrated_fp8), out, spec=spec, progress=False, threads=1,
                              options=ValidateOptions(engine=engine, kv_dtype="fp8", source_kv_dtype="fp32"))
        assert loads == [tiny_llama, calibrated_fp8] and resident == [1, 1], (engine, loads, resident)
        assert not list((out / "cache").glob("source-logits-*"))  # the temporary logits are gone
        assert (report["source"]["kv_dtype"], report["candidate"]["kv_dtype"]) == ("fp32", "fp8")
        kl[engine] = report["metrics"]["kl_mean"]["candidate"]
        assert 0 < kl[engine] < 0.05  # FP8 KV with calibrated scales: a small, nonzero change
        windows = eval_windows(tiny_tokenizer, 3, spec.ppl_window_len)
        direct = R.RUNNERS[engine].__mro__[1]  # the engine's runner class, untracked
        src, cand = direct(tiny_llama, "fp32"), direct(calibrated_fp8, "fp8")
        for record, ids in zip(report["samples"]["perplexity"], windows):
            expected = window_stats(src.logits(ids), cand.logits(ids), ids)
            assert record["kl"] == pytest.approx(expected["kl"], rel=1e-9)
            assert record["candidate_nll"] == pytest.approx(expected["candidate_nll"], rel=1e-9)
    assert kl["transformers"] == pytest.approx(kl["runtime"], rel=1e-4)


@pytest.mark.parametrize("engine", ["runtime", "transformers"])
def test_long_window_scores_its_last_positions_after_the_cache_holds_the_rest(tmp_path, tiny_llama, calibrated_fp8,
                                                                               tiny_tokenizer, engine):
    """The suite's long window: the NIAH prompt of its length, its last ppl_window_len positions scored (KL and NLL
    over ppl_window_len - 1 predictions) with the tokens before them in the cache; the record equals window_stats
    on the two models' logits of those positions, computed directly."""
    spec = dataclasses.replace(SUITES["smoke"], name="long", ppl_windows=2, ppl_window_len=32, long_window_len=400,
                               passkey_lengths=(), niah_lengths=(), ruler_tasks=(), longbench=False)
    report = run_validate(str(tiny_llama), str(calibrated_fp8), tmp_path / "out", spec=spec, progress=False,
                          threads=1, options=ValidateOptions(engine=engine, kv_dtype="fp8", source_kv_dtype="fp32"))
    records = report["samples"]["perplexity"]
    ids = torch.tensor(haystack.niah_sample(tiny_tokenizer, 400, 0.5).prompt_ids)
    start = len(ids) - 32
    assert [r["id"] for r in records] == ["w0", "w1", "long2"] and records[2]["context"] == start > 100
    assert report["metrics"][f"kl_mean_after_{start}"]["candidate"] == pytest.approx(records[2]["kl"] / 31)
    direct = R.RUNNERS[engine]
    src, cand = direct(tiny_llama, "fp32"), direct(calibrated_fp8, "fp8")
    assert src.logits(ids, start).shape[0] == 32
    torch.testing.assert_close(src.logits(ids, start), src.logits(ids)[start:], rtol=0, atol=1e-4)
    expected = window_stats(src.logits(ids)[start:], cand.logits(ids)[start:], ids[start:])
    assert records[2]["n_tokens"] == 31
    assert records[2]["kl"] == pytest.approx(expected["kl"], rel=1e-4)
    assert records[2]["candidate_nll"] == pytest.approx(expected["candidate_nll"], rel=1e-5)


def test_validate_refuses_up_front_when_a_model_cannot_fit(tmp_path, tiny_llama, monkeypatch):
    from kvconvert.memory import AVAILABLE_ENV

    monkeypatch.setenv(AVAILABLE_ENV, "1000B")
    with pytest.raises(KVConvertError, match=r"validate's source .* needs about .* only 0.00 GB is available"):
        run_validate(str(tiny_llama), str(tiny_llama), tmp_path / "r", ValidateOptions(engine="runtime"),
                     spec=dataclasses.replace(SUITES["smoke"], passkey_lengths=(), niah_lengths=(), ruler_tasks=(),
                                              longbench=False), progress=False)
    assert not list((tmp_path / "r" / "cache").glob("*.jsonl"))  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto means cuda on this machine")
def test_runners_take_a_device(tiny_llama, monkeypatch):
    """device cpu and auto (cpu here) give the same logits and fingerprint on both engines; cuda without a
    GPU is refused when the runner is made, before any model loads."""
    ids = torch.tensor([1, 5, 9, 2, 7])
    for engine in ("runtime", "transformers"):
        cpu, auto = (R.LazyRunner(tiny_llama, engine, "fp32", device=d) for d in ("cpu", "auto"))
        assert cpu.fingerprint == auto.fingerprint and torch.equal(cpu.logits(ids), auto.logits(ids))
        assert cpu.loaded.device == torch.device("cpu")
    assert R.RuntimeRunner(tiny_llama, "fp32", device="cpu").llm.device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KVConvertError, match="torch sees none"):
        R.LazyRunner(tiny_llama, "runtime", "fp32", device="cuda")


def test_long_samples_read_the_window_scored_before_them_from_the_prefix_cache(tiny_llama, tiny_tokenizer):
    """The runtime runner keeps the blocks of what it scored: a sample whose prompt is the long window (the suite's
    long NIAH sample) finds all of the window's full blocks cached, and gives what a fresh runner gives."""
    ids = torch.tensor(haystack.niah_sample(tiny_tokenizer, 400, 0.5).prompt_ids)
    runner = R.RuntimeRunner(tiny_llama, "fp32")
    runner.logits(ids, len(ids) - 32)
    short = R.SampleRequest(tuple(ids[:40].tolist()), 4, ())
    long = R.SampleRequest(tuple(ids.tolist()), 4, (), reference=(5, 6))
    before = runner.cached_prompt_tokens
    results = runner.run_samples([short, long])
    assert runner.cached_prompt_tokens - before >= len(ids) // R.RUNTIME_BLOCK * R.RUNTIME_BLOCK - R.RUNTIME_BLOCK
    alone = R.RuntimeRunner(tiny_llama, "fp32").run_samples([long])[0]
    assert results[1].tokens == alone.tokens
    assert results[1].answer["nll"] == pytest.approx(alone.answer["nll"], rel=1e-5)
