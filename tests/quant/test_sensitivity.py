"""`kvconvert sensitivity`: the KL of K-only and V-only rounding in llama.cpp's cache types, all layers and per
layer, on a tiny Llama (head_dim 64: llama.cpp's rotation applies) and through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from quant_cases import make_deepseek, make_llama

from kvconvert.checkpoint import CheckpointReader, load_tokenizer
from kvconvert.data import eval_windows
from kvconvert.errors import KVConvertError
from kvconvert.quant.capture import forward_with_hook, load_hf_model
from kvconvert.quant.hooks import llamacpp_hook
from kvconvert.quant.layout import detect_kv_layout
from kvconvert.quant.sensitivity import SensitivityOptions, cache_sensitivity
from kvconvert.token_stats import window_sums


@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("llama64"), head_dim=64, layers=2)


def test_k_only_v_only_and_both_and_each_layer(llama64):
    opts = SensitivityOptions(kv_dtype="q5_0/q4_0", windows=2, window_len=32)
    report = cache_sensitivity(llama64, opts)
    a = report["all"]
    assert (report["k_type"], report["v_type"]) == ("q5_0", "q4_0")
    assert all(v > 0 for v in a.values())
    # both halves rounded is exactly what validate's transformers engine measures with the pair's hook
    model = load_hf_model(llama64)
    with CheckpointReader(llama64, verify=False) as reader:
        hook = llamacpp_hook(detect_kv_layout(reader.config, reader.keys()), "q5_0/q4_0")
    kl = tokens = 0
    for ids in eval_windows(load_tokenizer(llama64), 2, 32):
        with torch.no_grad():
            sums = window_sums(forward_with_hook(model, ids[None], hook)[0], ids, model(ids[None]).logits[0])
        kl, tokens = kl + sums.kl, tokens + sums.tokens
    assert a["both"] == pytest.approx(kl / tokens, rel=1e-9)
    assert [r["layer"] for r in report["layers"]] == [0, 1]
    assert all(r["k_only"] > 0 and r["v_only"] > 0 for r in report["layers"])
    # the V half in a finer type loses less than in a coarser one, all else equal
    finer_v = cache_sensitivity(llama64, SensitivityOptions(kv_dtype="q5_0/q8_0", windows=2, window_len=32,
                                                            per_layer=False))
    assert finer_v["all"]["v_only"] < a["v_only"] and finer_v["all"]["k_only"] == a["k_only"]


def test_mla_and_unservable_shapes_are_refused(tmp_path):
    with pytest.raises(KVConvertError, match="no V half"):
        cache_sensitivity(make_deepseek(tmp_path / "mla", rope_dim=32), SensitivityOptions(windows=1, window_len=32))
    with pytest.raises(KVConvertError, match="do not divide the 48 values"):
        cache_sensitivity(make_llama(tmp_path / "l48", head_dim=48), SensitivityOptions(windows=1, window_len=32))


def test_the_command_prints_the_table_and_writes_json(llama64, tmp_path, run_main):
    out = tmp_path / "s.json"
    code, err = run_main(["sensitivity", "--src", llama64, "--kv-dtype", "iq4_nl", "--windows", "1", "--window-len",
                          "32", "--json", out])
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["kv_dtype"] == "iq4_nl" and len(report["layers"]) == 2
    code, err = run_main(["sensitivity", "--src", llama64, "--kv-dtype", "fp8"])
    assert code == 2 and "fp8" in err
