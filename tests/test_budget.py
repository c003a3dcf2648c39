"""KV-cache arithmetic (kvconvert.kvmath), presets, and `kvconvert budget`.

Expected numbers are written out by hand from the published configs, never computed by the code
under test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvconvert import kvmath
from kvconvert.commands.main import cli
from kvconvert.errors import KVConvertError, UnsupportedModelError
from kvconvert.presets import PRESETS

GiB = 2**30

# preset: (bf16 bytes/token, nvfp4 bytes/token), hand-calculated.
# Non-MLA: layers x 2 (K and V) x kv_heads x head_dim x 2 bytes; nvfp4 per head vector of head_dim
# values: head_dim/2 bytes of codes + head_dim/16 E4M3 scale bytes. MLA: layers x (512 + 64) values;
# 4-bit: the latent in 4 bits (256 + 32 bytes), k_rope kept in 16 bits (128 bytes), as the runtime stores it.
HAND_PER_TOKEN = {
    "llama-2-7b": (32 * 2 * 32 * 128 * 2, 32 * 2 * 32 * (64 + 8)),
    "llama-2-70b": (80 * 2 * 8 * 128 * 2, 80 * 2 * 8 * (64 + 8)),
    "llama-3.1-8b": (32 * 2 * 8 * 128 * 2, 32 * 2 * 8 * (64 + 8)),
    "llama-3.1-70b": (80 * 2 * 8 * 128 * 2, 80 * 2 * 8 * (64 + 8)),
    "llama-3.1-405b": (126 * 2 * 8 * 128 * 2, 126 * 2 * 8 * (64 + 8)),
    "mistral-7b": (32 * 2 * 8 * 128 * 2, 32 * 2 * 8 * (64 + 8)),
    "qwen2.5-7b": (28 * 2 * 4 * 128 * 2, 28 * 2 * 4 * (64 + 8)),
    "qwen2.5-72b": (80 * 2 * 8 * 128 * 2, 80 * 2 * 8 * (64 + 8)),
    "deepseek-v2-lite": (27 * (512 + 64) * 2, 27 * (288 + 128)),
    "deepseek-v3": (61 * (512 + 64) * 2, 61 * (288 + 128)),
    "smollm2-135m": (30 * 2 * 3 * 64 * 2, 30 * 2 * 3 * (32 + 4)),
}


def test_every_preset_has_a_hand_calculation():
    assert set(HAND_PER_TOKEN) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(HAND_PER_TOKEN))
def test_preset_bytes_per_token_match_hand_calculation(name):
    shape = kvmath.kv_shape(PRESETS[name]["config"])
    bf16, nvfp4 = HAND_PER_TOKEN[name]
    # every cached vector is a multiple of 32 values: int4 (0.5 B + fp16 scale per 32) = 0.5625 B/value
    expected = {"bf16": bf16, "fp16": bf16, "fp32": 2 * bf16, "fp8": bf16 // 2, "int8": bf16 // 2, "nvfp4": nvfp4,
                "int4": nvfp4}
    assert {fmt: kvmath.kv_bytes_per_token(shape, fmt) for fmt in expected} == expected


# Hand-counted parameters (embeddings x2 unless tied; per layer: attention + 3-matrix MLP + 2 norms).
HAND_PARAMETERS = {
    # 2*32000*4096 + 32*(4*4096^2 + 3*4096*11008 + 2*4096) + 4096
    "llama-2-7b": 2 * 32000 * 4096 + 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096,
    "llama-3.1-70b": 2 * 128256 * 8192 + 80 * (2 * 8192**2 + 2 * 1024 * 8192 + 3 * 8192 * 28672 + 2 * 8192) + 8192,
    # q/k/v biases: 3584 + 2 * 512 per layer
    "qwen2.5-7b": 2 * 152064 * 3584
    + 28 * (2 * 3584**2 + 2 * 512 * 3584 + 3584 + 1024 + 3 * 3584 * 18944 + 2 * 3584) + 3584,
    "smollm2-135m": 49152 * 576 + 30 * (2 * 576**2 + 2 * 192 * 576 + 3 * 576 * 1536 + 2 * 576) + 576,
}


@pytest.mark.parametrize("name", sorted(HAND_PARAMETERS))
def test_parameter_count_matches_hand_count(name):
    assert kvmath.parameter_count(PRESETS[name]["config"]) == HAND_PARAMETERS[name]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameters_consistent_with_config_and_published(name):
    preset = PRESETS[name]
    assert kvmath.parameter_count(preset["config"]) == preset["parameters"]
    published = preset["published"].split()[0]
    value, unit = float(published[:-1]), {"B": 1e9, "M": 1e6}[published[-1]]
    digits = len(published[:-1].split(".")[1]) if "." in published else 0
    scaled = preset["parameters"] / unit
    # published figures are rounded or truncated (Qwen: 7,615,616,512 -> "7.61B")
    assert abs(scaled - value) < 10**-digits, (name, scaled, published)


# ----------------------------------------------------------------------------------------------
# attention kinds, formats, shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, kind", [
    ({"num_attention_heads": 32, "num_key_value_heads": 32}, "MHA"),
    ({"num_attention_heads": 32}, "MHA"),
    ({"num_attention_heads": 32, "num_key_value_heads": 8}, "GQA"),
    ({"num_attention_heads": 32, "num_key_value_heads": 1}, "MQA"),
    ({"num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512}, "MLA"),
    ({"text_config": {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}}, "GQA"),
])
def test_attention_kind(config, kind):
    assert kvmath.attention_kind(config) == kind


@pytest.mark.parametrize("config, message", [
    ({"model_type": "mamba"}, "no num_attention_heads"),  # no attention kind
    ({"num_attention_heads": 8, "hidden_size": 512}, "num_layers"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8, "kv_lora_rank": 64}, "qk_rope_head_dim"),
    ({"num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 2, "head_dim": 64}, "multiple"),
])
def test_kv_shape_rejects_incomplete_configs(config, message):
    with pytest.raises(UnsupportedModelError, match=message):
        kvmath.kv_shape(config)


def test_head_dim_falls_back_to_hidden_over_heads():
    assert kvmath.head_dim({"hidden_size": 4096, "num_attention_heads": 32}) == 128
    assert kvmath.head_dim({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 64}) == 64


def test_mla_whatif_on_llama():
    shape = kvmath.kv_shape(PRESETS["llama-3.1-70b"]["config"])
    mla = kvmath.mla_whatif(shape, 512, 64)
    assert mla.kind == "MLA" and mla.values_per_token_per_layer == 576
    assert kvmath.kv_bytes_per_token(mla, "bf16") == 80 * 576 * 2
    with pytest.raises(KVConvertError, match="even"):
        kvmath.mla_whatif(shape, 512, 63)
    with pytest.raises(KVConvertError, match="head_dim"):
        kvmath.mla_whatif(shape, 512, 256)
    with pytest.raises(KVConvertError, match="positive"):
        kvmath.mla_whatif(shape, 0, 64)


def test_layer_windows():
    base = {"num_hidden_layers": 4}
    assert kvmath.layer_windows({**base, "sliding_window": None}) == [None] * 4
    assert kvmath.layer_windows({**base, "sliding_window": 4096}) == [4096] * 4  # Mistral v0.1
    qwen = {**base, "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 2}
    assert kvmath.layer_windows(qwen) == [None] * 4
    assert kvmath.layer_windows({**qwen, "use_sliding_window": True}) == [None, None, 4096, 4096]
    types = ["sliding_attention", "full_attention"] * 2
    assert kvmath.layer_windows({**base, "sliding_window": 512, "layer_types": types}) == [512, None, 512, None]


def test_bytes_per_request_caps_sliding_window_layers():
    shape = kvmath.KVShape("GQA", 2, 8, num_kv_heads=2, head_dim=64)
    per_layer = 2 * 2 * 64 * 2  # K and V, 2 heads, 64 values, bf16
    assert kvmath.kv_bytes_per_request(shape, "bf16", 1000, [100, None]) == per_layer * (100 + 1000)
    assert kvmath.kv_bytes_per_request(shape, "bf16", 50, [100, None]) == per_layer * (50 + 50)


@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("141 GB", 141 * 10**9), ("80G", 80 * 2**30),
    ("512MiB", 512 * 2**20), ("80", 80 * 2**30), ("1.5TiB", int(1.5 * 2**40)), ("100b", 100),
])
def test_parse_size(text, expected):
    assert kvmath.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "80 parsecs", "-1GB"])
def test_parse_size_rejects(text):
    with pytest.raises(KVConvertError, match="cannot read size"):
        kvmath.parse_size(text)


def test_a_bare_number_is_bytes_for_the_runtime(monkeypatch):
    """generate --kv-memory and $KVCONVERT_AVAILABLE_MEMORY read sizes with kvmath, a bare number as bytes."""
    from kvconvert.memory import AVAILABLE_ENV, available_memory

    sizes = [kvmath.parse_size(text, bare_unit=1) for text in ("1048576", "512M", "2GiB")]
    assert sizes == [2**20, 512 * 2**20, 2 * 2**30]
    monkeypatch.setenv(AVAILABLE_ENV, "4096")
    assert available_memory() == 4096
    monkeypatch.setenv(AVAILABLE_ENV, "16G")
    assert available_memory() == 16 * 2**30


def test_format_bytes():
    assert kvmath.format_bytes(327680) == "320.0 KiB"
    assert kvmath.format_bytes(42949672960) == "40.00 GiB"
    assert kvmath.format_bytes(12) == "12 B"


# ----------------------------------------------------------------------------------------------
# the CLI
# ----------------------------------------------------------------------------------------------


def _budget_json(*args):
    result = CliRunner().invoke(cli, ["budget", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


LLAMA_70B_128K = ["--model", "llama-3.1-70b", "--context", "131072"]


@pytest.mark.parametrize("args, expected", [
    # 80 layers x 2 x 8 KV heads x 128 x 2 bytes = 320 KiB per token; 40 GiB per 128K-token request
    (LLAMA_70B_128K + ["--batch", "1", "--kv-dtype", "bf16"],
     {"bytes_per_token": 327680, "bytes_per_request": 40 * GiB, "bytes_total": 42949672960}),
    (LLAMA_70B_128K + ["--kv-dtype", "fp8"], {"bytes_per_request": 20 * GiB}),
    (LLAMA_70B_128K + ["--batch", "4", "--kv-dtype", "fp8"], {"bytes_total": 80 * GiB}),
    # 80 layers x 16 vectors x (64 code bytes + 8 scale bytes) x 131072 tokens = 11.25 GiB, not 10
    (LLAMA_70B_128K + ["--kv-dtype", "nvfp4"], {"bytes_per_request": 80 * 16 * 72 * 131072}),
    (["--model", "llama-3.1-70b", "--context", "1000", "--mla-rank", "512", "--rope-dim", "64"],
     {"original_bytes_per_token": 327680, "bytes_per_token": 80 * 576 * 2, "bytes_per_request": 80 * 576 * 2 * 1000}),
    (["--model", "llama-3.1-70b", "--context", "1000", "--mla-rank", "256"], {"bytes_per_token": 80 * (256 + 64) * 2}),
    # the MLA-only nvfp4_fp8rope, against today's bf16: 80 x (256 + 32 code bytes + 32 block scales + 64 rope bytes)
    (["--model", "llama-3.1-70b", "--context", "1000", "--mla-rank", "512", "--kv-dtype", "nvfp4_fp8rope"],
     {"original_kv_dtype": "bf16", "original_bytes_per_token": 327680, "bytes_per_token": 80 * (256 + 32 + 64)}),
    (["--model", "deepseek-v3", "--context", "131072", "--kv-dtype", "fp8"],
     {"attention_kind": "MLA", "bytes_per_request": 61 * 576 * 131072}),
    # weights 2 x 8,030,261,248 bytes; a request of 8192 tokens is 32 x 2 x 8 x 128 x 2 x 8192 = 1 GiB
    (["--model", "llama-3.1-8b", "--context", "8192", "--batch", "64", "--gpu-mem", "80GiB"],
     {"weights_bytes": 8_030_261_248 * 2, "kv_budget_bytes": 80 * GiB - 8_030_261_248 * 2, "requests_fit": 65,
      "batch_fits": True}),
    (["--model", "llama-3.1-405b", "--context", "131072", "--gpu-mem", "80GiB"],
     {"requests_fit": 0, "batch_fits": False, "kv_budget_bytes": 0}),
    # fp8 weights: (141 GB - 70,553,706,496 bytes) // 20 GiB per request
    (LLAMA_70B_128K + ["--gpu-mem", "141GB", "--weights-dtype", "fp8", "--kv-dtype", "fp8"],
     {"weights_bytes": 70_553_706_496, "requests_fit": 3}),
    (["--model", "smollm2-135m"], {"context": 8192, "bytes_per_request": 23040 * 8192}),  # max_position_embeddings
])
def test_budget_json(args, expected):
    report = _budget_json(*args)
    assert {key: report[key] for key in expected} == expected


def test_budget_human_output_and_nvfp4_note():
    result = CliRunner().invoke(cli, ["budget", *LLAMA_70B_128K])
    assert result.exit_code == 0
    assert "327,680 bytes (320.0 KiB)" in result.output
    assert "42,949,672,960 bytes (40.00 GiB)" in result.output
    report = _budget_json(*LLAMA_70B_128K, "--kv-dtype", "nvfp4")
    assert any("ignores the block scales" in n and "10.00 GiB" in n for n in report["notes"])


def test_budget_from_config_json_with_sliding_window(tmp_path):
    # Mistral-7B v0.1: every layer slides over 4096 tokens, so a 32K request caches 4096 per layer.
    config = dict(PRESETS["mistral-7b"]["config"], sliding_window=4096, vocab_size=32000)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    report = _budget_json("--model", str(path), "--context", "32768")
    assert report["bytes_per_token"] == 131072
    assert report["bytes_per_request"] == 131072 * 4096
    assert any("sliding" in n for n in report["notes"])


def test_budget_from_folder_without_weights_counts_parameters_from_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["smollm2-135m"]["config"]))
    report = _budget_json("--model", str(tmp_path), "--context", "100", "--gpu-mem", "1GiB")
    assert report["parameters"] == 134_515_008
    assert report["requests_fit"] == (GiB - 134_515_008 * 2) // (23040 * 100)


@pytest.mark.parametrize("args, messages", [
    (["--model", "llama-9"], ["llama-3.1-70b", "smollm2-135m"]),  # an unknown model lists the known ones
    (["--rope-dim", "64"], ["needs --mla-rank"]),
    (["--mla-rank", "512", "--rope-dim", "65"], ["even"]),
    (["--batch", "0"], ["--batch"]),
    (["--context", "0"], ["--context"]),
    (["--gpu-mem", "eighty"], ["cannot read size"]),
    (["--model", "{mamba}"], ["num_attention_heads"]),  # an architecture without attention heads
])
def test_budget_bad_options_are_one_line_errors(args, messages, run_main, tmp_path):
    mamba = tmp_path / "config.json"
    mamba.write_text(json.dumps({"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24}))
    code, err = run_main(["budget", "--model", "llama-3.1-8b", "--context", "10",
                          *(a.format(mamba=mamba) for a in args)])
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert all(m in err for m in messages)


def test_budget_never_imports_torch():
    code = ("import sys; from kvconvert.commands.main import main\n"
            "try:\n    main(['budget', '--model', 'llama-3.1-70b', '--context', '131072', '--json'])\n"
            "except SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'budget imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["bytes_per_token"] == 327680


def test_a_kv_pair_counts_k_and_v_each_in_its_format():
    """--kv-dtype q5_0/iq4_nl (llama.cpp's -ctk / -ctv): K's bytes in q5_0 plus V's in iq4_nl; refused for an MLA
    what-if, whose row lives in llama.cpp's K cache."""
    from kvconvert.budget import BudgetOptions, budget_report
    from kvconvert.model_info import load_model_info

    info = load_model_info("smollm2-135m", prefer_preset=True)
    report = budget_report(info, BudgetOptions(kv_dtype="Q5_0/IQ4_NL", context=1024))
    halves = [budget_report(info, BudgetOptions(kv_dtype=d, context=1024))["bytes_per_token"] for d in ("q5_0", "iq4_nl")]
    assert report["kv_dtype"] == "q5_0/iq4_nl" and 2 * report["bytes_per_token"] == sum(halves)
    assert report["bytes_per_token"] == 30 * 3 * 2 * (22 + 18)  # layers x KV heads x 2 blocks of 32 x (K + V) bytes
    assert report["bytes_per_value"] == (22 + 18) / 2 / 32
    with pytest.raises(KVConvertError, match="MLA model caches one row"):
        budget_report(info, BudgetOptions(kv_dtype="q5_0/iq4_nl", mla_rank=256))
