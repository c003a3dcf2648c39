"""kvconvert's checkpoints in stock llama.cpp: `kvconvert export-gguf` (gguf-py, llama.cpp's own writer) and
llama.cpp's own loader, graph and KV caches through llama-cpp-python's C-API bindings
(kvconvert.engines.llamacpp), compared with transformers on the same windows.

Marked `llamacpp` where llama.cpp runs: they need llama-cpp-python in ./.venv (bash scripts/setup_llamacpp.sh);
without it they skip, and with KVCONVERT_REQUIRE_LLAMACPP=1 (scripts/test.sh, CI) they fail instead. The
export's own checks (refusals, the GGUF's keys and tensors) run everywhere.
"""

from __future__ import annotations

import json
import math
from contextlib import closing

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvconvert.checkpoint.gguf_export import export_gguf
from kvconvert.commands.main import cli
from kvconvert.engines.gguf_options import GGUFExportOptions
from kvconvert.engines.llamacpp import GGUFShape, LlamaCppContext, LlamaCppScorer, check_context, gguf_shape
from kvconvert.errors import KVConvertError
from kvconvert.eval.runner import TransformersRunner
from kvconvert.token_stats import TokenSums, window_sums

from mla_tiny_models import make_tiny_llama

llamacpp = pytest.mark.llamacpp
# conversion quality does not matter here, only that llama.cpp computes what transformers computes
FAST_CONVERT = ("--calib-tokens", "256", "--calib-window", "256", "--no-refit-o-proj", "--dtype", "fp32")
WINDOWS, WINDOW_LEN = 2, 256


def run_cli(*args: str) -> None:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output


def gguf_fields(path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items()}, {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module")
def windows(smollm2_path):
    from kvconvert.checkpoint import load_tokenizer
    from kvconvert.data import eval_windows

    return list(eval_windows(load_tokenizer(smollm2_path), WINDOWS, WINDOW_LEN))


def transformers_sums(folder, windows) -> TokenSums:
    with closing(TransformersRunner(folder, kv_dtype="fp32")) as runner:
        return sum((window_sums(runner.logits(w), w) for w in windows), TokenSums())


def llamacpp_sums(contexts, windows, reference="reference") -> dict[str, TokenSums]:
    totals: dict[str, TokenSums] = {}
    with LlamaCppScorer(contexts, n_ctx=WINDOW_LEN, threads=2) as engine:  # fixed: the same sums on any machine
        for w in windows:
            for name, sums in engine.score(w, reference=reference).items():
                totals[name] = totals.get(name, TokenSums()) + sums
    return totals


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory, smollm2_path):
    out = tmp_path_factory.mktemp("gguf") / "smollm2-f32.gguf"
    run_cli("export-gguf", "--src", str(smollm2_path), "--out", str(out), "--outtype", "f32")
    return out


@pytest.fixture(scope="module")
def smollm2_320(tmp_path_factory, smollm2_path):
    """SmolLM2 converted at 256 + 64, and its f32 GGUF."""
    folder = tmp_path_factory.mktemp("mla320")
    run_cli("mla", "--src", str(smollm2_path), "--rank", "256", "--rope-dim", "64", "--target", "llamacpp",
            *FAST_CONVERT, "--out", str(folder / "mla"))
    run_cli("export-gguf", "--src", str(folder / "mla"), "--out", str(folder / "mla.gguf"))
    return folder / "mla", folder / "mla.gguf"


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory, smollm2_path):
    """A random GQA Llama (4 query / 2 KV heads of 32, 2 layers) and its MLA conversion at 32 + 32."""
    folder = tmp_path_factory.mktemp("tiny")
    src = make_tiny_llama(folder / "src", smollm2_path, kv_heads=2, heads=4, head_dim=32)
    run_cli("mla", "--src", str(src), "--rank", "32", "--rope-dim", "32", "--target", "any", *FAST_CONVERT,
            "--out", str(folder / "mla"))
    return src, folder / "mla"


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory, tiny_mla):
    """tiny_mla's two checkpoints exported once (weights as stored: f32): {"llama": GGUFExport, "mla": ...}."""
    folder = tmp_path_factory.mktemp("tiny-gguf")
    src, mla = tiny_mla
    return {"llama": export_gguf(src, folder / "llama.gguf", GGUFExportOptions(outtype="f32")),
            "mla": export_gguf(mla, folder / "mla.gguf")}


# --------------------------------------------------------------------------- the export (no llama.cpp needed)

def test_llama_export_writes_llamas_keys_and_permuted_q_k(tiny_mla, tiny_ggufs):
    """LLAMA: q_proj / k_proj rows in llama.cpp's adjacent-pair RoPE order (convert_hf_to_gguf.py's permute),
    the rest as stored; the tokenizer as llama.cpp's converter writes SmolLM2's (pre "smollm")."""
    from safetensors.torch import load_file

    src, _ = tiny_mla
    report = tiny_ggufs["llama"]
    out = report.out
    assert report.arch == "llama" and report.tokenizer_pre == "smollm" and report.types == {"F32": report.tensors}
    fields, tensors = gguf_fields(out)
    assert fields["general.architecture"] == "llama" and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.dimension_count"] == 32 and fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.add_bos_token"] is False and len(fields["tokenizer.ggml.tokens"]) == 49152
    assert "output.weight" not in tensors  # tied embeddings: llama.cpp reuses token_embd
    weights = load_file(src / "model.safetensors")
    k = weights["model.layers.1.self_attn.k_proj.weight"]  # [2 heads x 32, 128]
    got = torch.from_numpy(np.array(tensors["blk.1.attn_k.weight"].data)).reshape(k.shape)
    half = k.view(2, 2, 16, 128)  # head, (first half | second half), pair, in
    assert torch.equal(got.view(2, 16, 2, 128), half.transpose(1, 2))  # row 2j, 2j+1 = pair j's two halves
    v = weights["model.layers.0.self_attn.v_proj.weight"]
    assert torch.equal(torch.from_numpy(np.array(tensors["blk.0.attn_v.weight"].data)).reshape(v.shape), v)


def test_mla_export_splits_kv_b_per_head_and_declares_no_experts(tmp_path, tiny_mla):
    """DEEPSEEK2: attn_k_b [heads, rank, nope] = each head's k rows of kv_b_proj transposed, attn_v_b [heads, v,
    rank]; q_lora_rank 0, no expert keys (kvconvert's n_routed_experts 1 / n_group 1 would abort llama.cpp)."""
    from safetensors.torch import load_file

    _, mla = tiny_mla
    out = tmp_path / "mla.gguf"
    report = export_gguf(mla, out, GGUFExportOptions(outtype="q8_0"))
    cfg = json.loads((mla / "config.json").read_text())
    heads, nope, v, rank = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    fields, tensors = gguf_fields(out)
    assert report.arch == "deepseek2" and fields["general.architecture"] == "deepseek2"
    assert fields["deepseek2.attention.q_lora_rank"] == 0 and fields["deepseek2.attention.kv_lora_rank"] == rank
    assert fields["deepseek2.attention.key_length"] == rank + 32 and fields["deepseek2.attention.value_length"] == rank
    assert fields["deepseek2.attention.key_length_mla"] == nope + 32
    assert fields["deepseek2.attention.head_count_kv"] == 1 and fields["deepseek2.leading_dense_block_count"] == 2
    assert not [k for k in fields if ".expert_count" in k or "expert_group" in k or "expert_used" in k]
    assert "blk.0.attn_kv_b.weight" not in tensors and "output.weight" in tensors
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"  # norms stay f32 under q8_0
    k_b, v_b = tensors["blk.1.attn_k_b.weight"], tensors["blk.1.attn_v_b.weight"]
    assert list(k_b.shape) == [nope, rank, heads] and list(v_b.shape) == [rank, v, heads]  # ggml order
    kv_b = load_file(next(mla.glob("*.safetensors")))["model.layers.1.self_attn.kv_b_proj.weight"].view(heads, nope + v,
                                                                                                        rank)
    from gguf.quants import dequantize

    got_k = torch.from_numpy(dequantize(k_b.data, k_b.tensor_type)).reshape(heads, rank, nope)
    got_v = torch.from_numpy(dequantize(v_b.data, v_b.tensor_type)).reshape(heads, v, rank)
    scale = kv_b.abs().max()
    assert (got_k - kv_b[:, :nope].transpose(1, 2)).abs().max() <= scale / 127  # q8_0: half a step of the block max
    assert (got_v - kv_b[:, nope:]).abs().max() <= scale / 127


def test_export_refuses_bad_inputs_with_one_line(tmp_path, run_main, tiny_mla):
    src, _ = tiny_mla
    existing = tmp_path / "there.gguf"
    existing.write_bytes(b"not mine")
    code, err = run_main(["export-gguf", "--src", src, "--out", existing])
    assert code == 2 and "output exists; choose another --out or pass --overwrite" in err
    assert existing.read_bytes() == b"not mine"
    code, err = run_main(["export-gguf", "--src", src, "--out", tmp_path / "model.bin"])
    assert code == 2 and "must name a .gguf file" in err
    code, err = run_main(["export-gguf", "--src", src, "--out", src / "inside.gguf"])
    assert code == 2 and "lies inside the source" in err
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    code, err = run_main(["export-gguf", "--src", other, "--out", tmp_path / "gpt2.gguf"])
    assert code == 2 and "model_type 'gpt2' (GPT2LMHeadModel)" in err and "export-gguf writes Llama-family" in err
    assert len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob(".*.tmp-*")) and not (tmp_path / "gpt2.gguf").exists()


def test_cache_checks_follow_llamas_rules(tmp_path, tiny_ggufs):
    """What llama.cpp refuses (src/llama-context.cpp) is refused before its worker starts, with the reason."""
    llama, deepseek = gguf_shape(tiny_ggufs["llama"].out), gguf_shape(tiny_ggufs["mla"].out)
    assert (llama.arch, llama.mla, llama.head_k, llama.vocab) == ("llama", False, 32, 49152)
    assert (deepseek.arch, deepseek.mla, deepseek.head_k, deepseek.head_v) == ("deepseek2", True, 64, 32)
    check_context(LlamaCppContext("a", "x", cache="q4_0", cache_v="f16"), llama)
    with pytest.raises(KVConvertError, match="MLA model caches its latent once.*equal K and V cache types"):
        check_context(LlamaCppContext("a", "x", cache="q4_0", cache_v="f16"), deepseek)
    with pytest.raises(KVConvertError, match="quantized V cache needs flash attention"):
        check_context(LlamaCppContext("a", "x", cache="q8_0", flash_attn="off"), llama)
    with pytest.raises(KVConvertError, match="unknown; llama.cpp takes f32, f16, bf16, q8_0, q4_0"):
        check_context(LlamaCppContext("a", "x", cache="fp8"), llama)
    odd = GGUFShape("llama", False, 48, 48, 49152)
    with pytest.raises(KVConvertError, match="blocks of 32 values, which do not divide the 48 values"):
        check_context(LlamaCppContext("a", "x", cache="q4_0"), odd)
    with pytest.raises(KVConvertError, match="GGUF file not found"):
        gguf_shape(tmp_path / "missing.gguf")


# --------------------------------------------------------------------------- stock llama.cpp

@llamacpp
def test_source_gguf_scores_like_transformers(llamacpp_ready, smollm2_path, smollm2_gguf, windows):
    """SmolLM2 fp32 as LLAMA with an f32 cache: llama.cpp's perplexity within 0.1% of transformers' on the same
    windows (measured: 0.007%); an f16 cache is within rounding of it."""
    reference = transformers_sums(smollm2_path, windows)
    got = llamacpp_sums([LlamaCppContext("reference", str(smollm2_gguf), cache="f32"),
                         LlamaCppContext("f16", str(smollm2_gguf), cache="f16")], windows)
    assert got["reference"].tokens == reference.tokens == WINDOWS * (WINDOW_LEN - 1)
    assert abs(got["reference"].ppl / reference.ppl - 1) < 1e-3, (got["reference"].ppl, reference.ppl)
    assert got["f16"].kl_mean < 1e-4 and got["f16"].top1_rate > 0.99


@llamacpp
def test_quantized_caches_run_and_the_rotation_helps(llamacpp_ready, smollm2_gguf, windows):
    """q8_0 and q4_0 K/V caches (flash attention on, as llama.cpp requires for a quantized V) against an f32
    cache on the same windows: q8_0 costs almost nothing, q4_0 more, and q4_0 without llama.cpp's Hadamard
    rotation (LLAMA_ATTN_ROT_DISABLE=1) more again (measured on these windows: KL 0.0003, 0.054, 0.164)."""
    gguf = str(smollm2_gguf)
    got = llamacpp_sums([LlamaCppContext("reference", gguf, cache="f32"),
                         LlamaCppContext("q8_0", gguf, cache="q8_0", flash_attn="on"),
                         LlamaCppContext("q4_0", gguf, cache="q4_0", flash_attn="on"),
                         LlamaCppContext("q4_0 unrotated", gguf, cache="q4_0", flash_attn="on", rotation=False)], windows)
    assert got["reference"].kl == 0.0
    assert 0 < got["q8_0"].kl_mean < 0.003 and got["q8_0"].top1_rate > 0.95
    assert 0.01 < got["q4_0"].kl_mean < 0.15 < got["q4_0 unrotated"].kl_mean * 1.5
    assert got["q4_0"].kl_mean < got["q4_0 unrotated"].kl_mean / 1.5
    assert got["q4_0"].ppl > got["q8_0"].ppl and math.isfinite(got["q4_0 unrotated"].ppl)


@llamacpp
def test_mla_gguf_scores_like_transformers_and_runs_a_q4_0_latent(llamacpp_ready, smollm2_320, windows):
    """SmolLM2 at 256 + 64 as DEEPSEEK2 (latent 320 in llama.cpp's K cache): an f32 cache scores within 0.1% of
    transformers' DeepseekV3 on the same windows; a q4_0 latent (K and V one type, flash attention) runs and
    costs a measurable KL, the same with or without LLAMA_ATTN_ROT_DISABLE: llama.cpp's MLA path does not
    rotate its cache (kvconvert.engines.llamacpp)."""
    folder, gguf = smollm2_320
    reference = transformers_sums(folder, windows)
    got = llamacpp_sums([LlamaCppContext("reference", str(gguf), cache="f32"),
                         LlamaCppContext("q4_0", str(gguf), cache="q4_0", flash_attn="on"),
                         LlamaCppContext("q4_0 unrotated", str(gguf), cache="q4_0", flash_attn="on", rotation=False)],
                        windows)
    assert abs(got["reference"].ppl / reference.ppl - 1) < 1e-3, (got["reference"].ppl, reference.ppl)
    assert 0.01 < got["q4_0"].kl_mean < 1.0 and math.isfinite(got["q4_0"].ppl)
    assert got["q4_0 unrotated"] == got["q4_0"]


@llamacpp
def test_an_abort_inside_llama_cpp_is_a_clear_error(llamacpp_ready, tmp_path):
    """The GGUF llama.cpp's own converter writes for kvconvert's dense MLA config (n_routed_experts 1, n_group 1)
    makes llama.cpp abort (GGML_ASSERT) while loading: the worker dies, kvconvert gets a KVConvertError with
    llama.cpp's assertion, and goes on."""
    import gguf

    from kvconvert.checkpoint.gguf_export import write_hparams

    cfg = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
           "vocab_size": 8, "kv_lora_rank": 32, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "model_type": "deepseek_v3"}
    path = tmp_path / "experts.gguf"
    writer = gguf.GGUFWriter(path, arch="deepseek2")
    write_hparams(writer, cfg, "deepseek2", "f32", "experts")
    writer.add_expert_count(1)
    writer.add_expert_used_count(1)
    writer.add_expert_group_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(KVConvertError, match=r"(?s)llama.cpp worker ended \(killed by signal 6\).*GGML_ASSERT") as exc:
        LlamaCppScorer([LlamaCppContext("reference", str(path), cache="f16")], n_ctx=64, threads=1).start()
    # the log's lines are quoted; its scratch file, removed with the worker, is not named
    assert "(llama.cpp worker's log):" in str(exc.value) and "llamacpp.log" not in str(exc.value)


@llamacpp
def test_bad_requests_are_refused_and_the_worker_goes_on(llamacpp_ready, tiny_ggufs):
    gguf = str(tiny_ggufs["llama"].out)
    with LlamaCppScorer([LlamaCppContext("reference", gguf)], n_ctx=64, threads=1) as engine:
        with pytest.raises(KVConvertError, match="a window of 65 tokens exceeds the context of 64"):
            engine.score(list(range(65)))
        with pytest.raises(KVConvertError, match=r"llama.cpp \(score\): token ids outside the model's vocabulary"):
            engine.score([1, 2, 49152])
        with pytest.raises(KVConvertError, match="reference 'other' is not a context"):
            engine.score([1, 2, 3], reference="other")
        assert engine.score([1, 2, 3])["reference"].tokens == 2
        assert engine.info()["contexts"]["reference"]["vocab"] == 49152


# --------------------------------------------------------------------------- validate --engine llamacpp

def test_validate_refuses_a_cache_llama_cpp_has_not(tmp_path, run_main, tiny_mla, llamacpp_ready):
    src, mla = tiny_mla
    code, err = run_main(["validate", "--source", src, "--candidate", mla, "--engine", "llamacpp", "--kv-dtype", "nvfp4",
                          "--suite", "smoke", "--out", tmp_path / "report"])
    assert code == 2 and "--engine llamacpp: the candidate's KV format 'nvfp4' has no llama.cpp cache" in err
    assert not (tmp_path / "report" / "report.json").exists()  # refused before the suite


@llamacpp
def test_validate_engine_llamacpp_scores_the_suites_windows(tmp_path, run_main, tiny_mla, llamacpp_ready):
    """A tiny Llama against its MLA conversion, the smoke suite: llama.cpp's section sits beside the runtime's in
    report.json and report.md, on the same windows (same token count), and the source's perplexity agrees with
    the runtime's (fp32 weights; f32 cache in llama.cpp, fp32 in the runtime)."""
    src, mla = tiny_mla
    out = tmp_path / "report"
    code, err = run_main(["validate", "--source", src, "--candidate", mla, "--engine", "llamacpp", "--suite", "smoke",
                          "--source-kv-dtype", "fp32", "--kv-dtype", "fp32", "--threads", "1", "--no-progress",
                          "--out", out])
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    section = report["engines"]["llamacpp"]
    assert section["settings"]["kv_cache"] == {"source": "f32", "candidate": "f32"}
    assert section["tokens"] == report["metrics"]["perplexity"]["tokens"]
    runtime = report["metrics"]["perplexity"]
    assert abs(section["perplexity"]["source"] / runtime["source"] - 1) < 1e-3
    assert abs(section["perplexity"]["candidate"] / runtime["candidate"] - 1) < 1e-3
    assert section["bundled"]["perplexity"] == {k: runtime[k] for k in ("source", "candidate", "delta_pct")}
    assert "## Stock llama.cpp (same perplexity windows)" in (out / "report.md").read_text()
    assert not (out / "cache" / "llamacpp-gguf").exists()  # the GGUF exports are scratch


@llamacpp
def test_validate_q4_0_runtime_emulation_beside_llama_cpp(tmp_path, run_main, tiny_mla, llamacpp_ready):
    """--kv-dtype q4_0 on a tiny Llama against itself: the runtime's emulation of llama.cpp's q4_0 cache and
    llama.cpp's own cache cost about the same KL on the same windows (SmolLM2's smoke windows, measured:
    0.0435 vs 0.0449 rotated, 0.139 vs 0.145 with --no-llamacpp-rotation)."""
    src, _ = tiny_mla
    out = tmp_path / "report"
    code, err = run_main(["validate", "--source", src, "--candidate", src, "--engine", "llamacpp", "--suite", "smoke",
                          "--source-kv-dtype", "fp32", "--kv-dtype", "q4_0", "--threads", "1", "--no-progress",
                          "--out", out])
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    engine, runtime = report["engines"]["llamacpp"]["kl_mean"], report["metrics"]["kl_mean"]["candidate"]
    assert report["engines"]["llamacpp"]["settings"]["kv_cache"] == {"source": "f32", "candidate": "q4_0"}
    assert engine > 0 and runtime > 0 and 0.7 < runtime / engine < 1.4, (runtime, engine)
    # head size 32: llama.cpp does not rotate it (nor does the emulation), and the report says so, not "on"
    applied = report["engines"]["llamacpp"]["settings"]["rotation_applied"]
    assert applied == {"source": "none (f32 is not quantized)",
                       "candidate": "none (llama.cpp rotates only head sizes that are multiples of 64; this one is 32)"}
    markdown = (out / "report.md").read_text()
    assert "rotation of quantized caches on" not in markdown and "this one is 32" in markdown


def test_the_report_says_what_llama_cpps_rotation_does_to_each_shape(monkeypatch):
    """llama.cpp's rule (src/llama-kv-cache.cpp): a quantized cache, a head size that is a multiple of 64, the switch
    on; never the MLA latent. The runtime's emulation follows it shape by shape."""
    from kvconvert.eval.engine_llamacpp import rotation_applied
    from kvconvert.ggml_formats import ROTATION_ENV, llamacpp_frames

    monkeypatch.delenv(ROTATION_ENV, raising=False)
    llama = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert rotation_applied({**llama, "head_dim": 128}, "q4_0") == "on (K in Hadamard groups of 128, V of 64)"
    assert rotation_applied({**llama, "head_dim": 64}, "q8_0") == "on (K in Hadamard groups of 64, V of 64)"
    assert "this one is 32" in rotation_applied({**llama, "head_dim": 32}, "q4_0")
    assert "this one is 96" in rotation_applied({**llama, "head_dim": 96}, "q4_0")
    assert rotation_applied({**llama, "head_dim": 64}, "f16") == "none (f16 is not quantized)"
    assert "MLA path" in rotation_applied({"kv_lora_rank": 256, "qk_rope_head_dim": 64}, "q4_0")
    for size, rotated in ((32, False), (48, False), (64, True), (128, True)):
        frames = llamacpp_frames("q4_0", "q4_0", size, False)
        assert (frames["k"].rotation is not None, frames["v"].rotation is not None) == (rotated, rotated)
    monkeypatch.setenv(ROTATION_ENV, "1.5")
    assert rotation_applied({**llama, "head_dim": 64}, "q4_0") == "off (LLAMA_ATTN_ROT_DISABLE)"


def test_export_says_when_llama_cpp_serves_only_a_float_cache(tmp_path, run_main, smollm2_path):
    """head_dim 16: llama.cpp's quantized caches (blocks of 32) cannot hold it; export-gguf writes the model and says
    so, with the rule calibrate, validate and plan refuse it by."""
    src = make_tiny_llama(tmp_path / "src", smollm2_path, kv_heads=2, heads=4, head_dim=16)
    code, err = run_main(["export-gguf", "--src", src, "--out", tmp_path / "m.gguf"])
    assert code == 0, err
    assert "float cache only" in err and "do not divide the 16 values of a cached K head" in err
    smollm2 = run_main(["export-gguf", "--src", smollm2_path, "--out", tmp_path / "s.gguf"])
    assert smollm2[0] == 0 and "float cache only" not in smollm2[1]
