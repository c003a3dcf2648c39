"""Model runners on a tiny random Llama: logits, greedy decoding, fingerprints, engine checks."""

import shutil

import pytest
import torch
from eval_fixtures import save_tiny_deepseek, save_tiny_llama, train_tokenizer

from kvconvert.errors import KVConvertError
from kvconvert.eval import runner as R


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


def test_greedy_equals_argmax_of_full_recompute(hf_runner):
    """The cached decode loop must pick what a from-scratch forward would pick at every step."""
    ids = torch.arange(5, 25)
    tokens = hf_runner.greedy(ids, 12, stop_ids=())
    assert len(tokens) == 12
    seq = ids.clone()
    for token in tokens:
        assert int(hf_runner.logits(seq)[-1].argmax()) == token
        seq = torch.cat([seq, torch.tensor([token])])


def test_greedy_stops_before_stop_token(hf_runner):
    ids = torch.arange(5, 25)
    tokens = hf_runner.greedy(ids, 12, stop_ids=())
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


def test_runtime_runner_matches_transformers_with_fp32_kv(tiny_llama, hf_runner):
    if R.runtime_available() is not None:
        pytest.skip(f"kvconvert.runtime not importable: {R.runtime_available()}")
    runtime = R.RuntimeRunner(tiny_llama, kv_dtype="fp32")
    ids = torch.arange(3, 60)
    torch.testing.assert_close(runtime.logits(ids), hf_runner.logits(ids), rtol=1e-4, atol=1e-4)
    assert runtime.greedy(ids, 10, (0,)) == hf_runner.greedy(ids, 10, (0,))
    first = hf_runner.greedy(ids, 1, ())[0]
    assert runtime.greedy(ids, 6, (first,), min_new_tokens=1) == hf_runner.greedy(ids, 6, (first,), min_new_tokens=1)
    assert runtime.fingerprint != hf_runner.fingerprint  # engine is part of the key


def test_deepseek_v3_candidate_runs_in_both_engines(tmp_path, tiny_tokenizer_dir, tiny_tokenizer):
    """A stock DeepSeek-V3 (MLA) checkpoint, what `kvconvert mla` writes, runs in transformers and
    in the runtime with the same logits (fp32 KV) and the same greedy tokens."""
    folder = save_tiny_deepseek(tmp_path / "dsv3", len(tiny_tokenizer), tokenizer_dir=tiny_tokenizer_dir)
    hf = R.TransformersRunner(folder)
    ids = torch.arange(3, 100)
    logits = hf.logits(ids)
    assert logits.shape == (97, len(tiny_tokenizer))
    if R.runtime_available() is not None:
        pytest.skip(f"kvconvert.runtime not importable: {R.runtime_available()}")
    runtime = R.RuntimeRunner(folder, "fp32")
    torch.testing.assert_close(runtime.logits(ids), logits, rtol=1e-4, atol=1e-4)
    assert runtime.greedy(ids, 8, (0,)) == hf.greedy(ids, 8, (0,))


def test_quantized_kv_without_scales_is_refused_before_loading(tiny_llama):
    with pytest.raises(KVConvertError, match="needs KV scales.*kvconvert calibrate"):
        R.LazyRunner(tiny_llama, "transformers", "fp8")
    if R.runtime_available() is None:
        with pytest.raises(KVConvertError, match="--kv-scales dynamic"):
            R.LazyRunner(tiny_llama, "runtime", "nvfp4")
    with pytest.raises(KVConvertError, match="unknown"):
        R.resolve_kv_dtype("runtime", "int4")


def test_fake_quant_kv_in_transformers_matches_the_runtime_bit_for_bit(calibrated_fp8):
    """Both engines quantize the cached K/V with the same scales (bit-exact formats), so an FP8 KV
    candidate scores the same whichever engine runs it; and FP8 really changes the logits."""
    if R.runtime_available() is not None:
        pytest.skip(f"kvconvert.runtime not importable: {R.runtime_available()}")
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
    other = save_tiny_llama(tmp_path / "other", len(tiny_tokenizer), seed=1)
    assert R.checkpoint_fingerprint(other) != R.checkpoint_fingerprint(tiny_llama)
    base = R.runner_fingerprint(tiny_llama, "runtime", "bf16", "checkpoint")
    assert base != R.runner_fingerprint(tiny_llama, "runtime", "fp8", "checkpoint")
    assert R.runner_fingerprint(tiny_llama, "runtime", "fp8", "checkpoint") != R.runner_fingerprint(
        tiny_llama, "runtime", "fp8", "dynamic")
    assert base != R.runner_fingerprint(tiny_llama, "transformers", "bf16", "checkpoint")


def test_manifest_fingerprint_ignores_creation_time_but_not_stale_manifests(tmp_path):
    import json

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
    R.check_same_tokenizer(tiny_tokenizer, R.load_tokenizer(tiny_tokenizer_dir), tiny_tokenizer_dir, tiny_tokenizer_dir)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(KVConvertError, match="no tokenizer files"):
        R.load_tokenizer(tmp_path)


def test_engine_resolution():
    assert R.resolve_engine("transformers") == "transformers"
    with pytest.raises(KVConvertError, match="unknown"):
        R.resolve_engine("vllm")
    expected = "runtime" if R.runtime_available() is None else "transformers"
    assert R.resolve_engine("auto") == expected
