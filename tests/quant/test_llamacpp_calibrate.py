"""`kvconvert calibrate --kv-dtype q4_0` (llama.cpp's cache types): the weights are prepared for the engine's
rotated block quantizer (key pair balance; latent shaping for MLA), nothing else is written, and the model
computes what it did."""

from __future__ import annotations

import pytest
import torch
from quant_cases import assert_same_logits, make_deepseek, make_llama, read_json
from safetensors.torch import load_file

from kvconvert.checkpoint import CheckpointReader
from kvconvert.quant.rotate import pair_balance_scale

TINY = ["--calib-tokens", "256", "--window-len", "64", "--batch-size", "2", "--quiet"]


@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("llama64"), head_dim=64)


def test_q4_0_folds_the_key_balance_and_writes_no_scales(llama64, calib_text, tmp_path, run_main):
    out = tmp_path / "q4"
    code, err = run_main(["calibrate", "--src", llama64, "--out", out, "--kv-dtype", "q4_0", "--calib-data",
                          calib_text, *TINY])
    assert code == 0, err
    report = read_json(out / "calibration_report.json")
    assert report["kv_dtype"] == "q4_0" and report["formats"] == []
    assert set(report["rotation"]) == {"key_pair_balance"}  # no phase, no V Hadamard: the engine rotates itself
    assert 0 < report["rotation"]["key_pair_balance"]["predicted_noise_ratio_mean"] <= 1
    assert all("k_scale" not in entry for entry in report["layers"])
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(f))
    assert not [n for n in tensors if n.endswith(("k_scale", "v_scale"))]
    src = CheckpointReader(llama64)
    changed = {n for n in src.weight_map if not torch.equal(tensors[n], src.get(n))}
    assert changed == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qk"}
    assert "quantization_config" not in read_json(out / "config.json")
    assert_same_logits(out, llama64)


def test_mla_q4_0_shapes_the_latent(tmp_path, calib_text, run_main):
    src = make_deepseek(tmp_path / "mla", rope_dim=32)  # 32 + 32: whole blocks of 32, as llama.cpp serves
    out = tmp_path / "q4"
    code, err = run_main(["calibrate", "--src", src, "--out", out, "--kv-dtype", "q4_0", "--calib-data", calib_text,
                          *TINY])
    assert code == 0, err
    rotation = read_json(out / "calibration_report.json")["rotation"]
    assert "latent_shaping" in rotation and "key_pair_balance" not in rotation  # the MLA row is not rotated


@pytest.mark.parametrize("flags, message", [
    (["--format", "vllm"], "no KV scales to export"),
    (["--granularity", "head"], "no KV scales to export"),
])
def test_scale_options_are_refused(flags, message, llama64, tmp_path, run_main):
    code, err = run_main(["calibrate", "--src", llama64, "--out", tmp_path / "x", "--kv-dtype", "q4_0", *flags, *TINY])
    assert code == 2 and message in err and not (tmp_path / "x").exists()


def test_pair_balance_scale_is_the_cauchy_schwarz_optimum():
    """At power 1 the scales minimize E|q/s|^2 E|s k|^2 over all per-pair scales: random ones never do better."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.rand(3, 32, generator=g, dtype=torch.float64) * 10, torch.rand(3, 32, generator=g, dtype=torch.float64)

    def noise(s):
        return (q / s ** 2).sum(-1) * (k * s ** 2).sum(-1)
    best = noise(pair_balance_scale(q, k, 1.0))
    torch.testing.assert_close(best, (q * k).sqrt().sum(-1) ** 2)
    for _ in range(20):
        assert bool((noise(torch.rand(3, 32, generator=g, dtype=torch.float64) + 0.1) >= best - 1e-9).all())
    assert torch.equal(pair_balance_scale(q, k, 0.0), torch.ones_like(q))
    assert torch.allclose(pair_balance_scale(q, k, 1.0).log().mean(-1), torch.zeros(3, dtype=torch.float64))


def test_a_pair_calibrates_for_its_k_and_v_types(llama64, calib_text, tmp_path, run_main):
    """q5_0/iq4_nl: llama.cpp's K in q5_0 and V in iq4_nl; both are its rotated block types, so the keys get the pair
    balance and nothing is exported, as for one type; the report names the pair."""
    out = tmp_path / "pair"
    code, err = run_main(["calibrate", "--src", llama64, "--out", out, "--kv-dtype", "Q5_0/IQ4_NL", "--calib-data",
                          calib_text, *TINY])
    assert code == 0, err
    report = read_json(out / "calibration_report.json")
    assert report["kv_dtype"] == "q5_0/iq4_nl" and report["formats"] == []
    assert set(report["rotation"]) == {"key_pair_balance"}
    assert_same_logits(out, llama64)


@pytest.mark.parametrize("kv_dtype", ["fp8/q4_0", "q5_0/nvfp4"])
def test_pairs_outside_llamacpps_types_are_refused(kv_dtype, llama64, tmp_path, run_main):
    code, err = run_main(["calibrate", "--src", llama64, "--out", tmp_path / "x", "--kv-dtype", kv_dtype, *TINY])
    assert code == 2 and "llama.cpp" in err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("model, kv_dtype, message", [
    (dict(head_dim=48), "q4_0", "do not divide the 48 values of a cached K head"),
    (dict(head_dim=16), "q5_0/iq4_nl", "do not divide the 16 values of a cached K head"),
    (dict(kv_lora_rank=32, rope_dim=16), "q4_0", "do not divide the 48 values of a cached K head"),  # MLA 32+16
    (dict(kv_lora_rank=48, rope_dim=16), "q8_0", "do not divide the 48 values of a cached V head"),  # row 64, view 48
    (dict(kv_lora_rank=32, rope_dim=32), "q5_0/iq4_nl", "MLA model caches one row"),
])
def test_shapes_llamacpp_cannot_serve_are_refused_up_front(model, kv_dtype, message, tmp_path, run_main):
    """llama.cpp refuses a quantized cache whose blocks of 32 do not tile each cached head (the MLA row and its
    latent V view): calibrate refuses it before any work, with the one rule the engine check uses."""
    src = make_deepseek(tmp_path / "m", **model) if "rope_dim" in model else make_llama(tmp_path / "m", **model)
    code, err = run_main(["calibrate", "--src", src, "--out", tmp_path / "x", "--kv-dtype", kv_dtype, *TINY])
    assert code == 2 and message in err, err
    assert not (tmp_path / "x").exists()
