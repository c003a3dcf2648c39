"""`kvconvert inspect`: folders (headers only), config files, presets, unknown architectures."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kvconvert.checkpoint import CheckpointWriter
from kvconvert.commands.main import cli
from kvconvert.presets import PRESETS


def _inspect(*args) -> dict:
    result = CliRunner().invoke(cli, ["inspect", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.slow
def test_smollm2_inspect(smollm2_path):
    report = _inspect("smollm2-135m")
    assert report["path"] == str(smollm2_path.resolve())
    assert report["architecture"] == "LlamaForCausalLM" and report["attention_kind"] == "GQA"
    assert (report["num_hidden_layers"], report["num_attention_heads"], report["num_key_value_heads"],
            report["head_dim"]) == (30, 9, 3, 64)
    # 30 layers x 2 x 3 heads x 64 x 2 bytes; fp8 half; nvfp4 30 x 6 x (32 + 4)
    assert report["kv_bytes_per_token"] == {"bf16": 23040, "fp8": 11520, "nvfp4": 6480}
    # llama.cpp's blocks of 32: q8_0 34 bytes, q5_0 22, iq4_nl 18; 30 layers x 3 heads x 2 blocks per K or V head
    assert report["llamacpp_kv_bytes_per_token"] == {"q8_0": 180 * 68, "q5_0/iq4_nl": 180 * (22 + 18),
                                                     "iq4_nl": 180 * 36}
    assert report["parameters"] == 134_515_008 and report["parameters_source"] == "safetensors headers"
    assert report["tensor_dtypes"] == {"F32": 134_515_008}
    result = CliRunner().invoke(cli, ["inspect", str(smollm2_path)])  # the same, as text
    assert result.exit_code == 0
    assert "GQA: 30 layers, 9 heads, 3 KV heads, head_dim 64" in result.output
    assert "bf16 23,040 B" in result.output and "134,515,008" in result.output


def _tiny_llama_folder(path, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, **overrides)
    model = LlamaForCausalLM(config)
    with CheckpointWriter(path, max_shard_bytes=40_000) as w:
        for name, t in model.state_dict().items():
            if not (config.tie_word_embeddings and name == "lm_head.weight"):
                w.add(name, t.to(torch.bfloat16))
        w.write_config({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    return model


def test_sharded_folder_parameters_from_headers(tmp_path):
    model = _tiny_llama_folder(tmp_path / "m", tie_word_embeddings=False)
    report = _inspect(str(tmp_path / "m"))
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    assert report["tensor_dtypes"] == {"BF16": report["parameters"]}
    assert report["attention_kind"] == "GQA" and report["head_dim"] == 8
    assert report["kv_bytes_per_token"]["bf16"] == 3 * 2 * 2 * 8 * 2
    # nvfp4 on head_dim 8: 4 code bytes + one scale for the (partial) block of 16
    assert report["kv_bytes_per_token"]["nvfp4"] == 3 * 2 * 2 * (4 + 1)
    # llama.cpp's blocks of 32 do not divide a head of 8: no quantized llama.cpp cache, and the note says why
    assert report["llamacpp_kv_bytes_per_token"] == {}
    assert any("llama.cpp serves this model with a 16-bit cache only" in n and "8 values of a cached K head" in n
               for n in report["notes"])
    assert report["weights_bytes"] == sum(p.stat().st_size for p in (tmp_path / "m").glob("*.safetensors"))


@pytest.mark.parametrize("kv_heads, kind", [(8, "MHA"), (1, "MQA")])
def test_attention_kinds_from_folders(tmp_path, kv_heads, kind):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 512,
         "num_attention_heads": 8, "num_key_value_heads": kv_heads}))
    report = _inspect(str(tmp_path))
    assert report["attention_kind"] == kind
    assert report["kv_bytes_per_token"]["bf16"] == 2 * 2 * kv_heads * 64 * 2
    assert any("no safetensors" in n for n in report["notes"])


def test_deepseek_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PRESETS["deepseek-v3"]["config"]))
    report = _inspect(str(path))
    assert report["attention_kind"] == "MLA" and report["path"] is None
    assert (report["kv_lora_rank"], report["qk_rope_head_dim"], report["head_dim"]) == (512, 64, None)
    assert report["kv_bytes_per_token"] == {"bf16": 61 * 576 * 2, "fp8": 61 * 576, "nvfp4": 61 * (288 + 128)}
    # one row [latent | k_rope] of 576 values in one type: no K/V pair
    assert report["llamacpp_kv_bytes_per_token"] == {"q8_0": 61 * 18 * 34, "iq4_nl": 61 * 18 * 18}
    assert report["parameters"] == 671_026_419_200 and report["parameters_source"] == "config"


def test_preset_name():
    report = _inspect("llama-3.1-70b")
    assert report["origin"] == "preset" and report["kv_bytes_per_token"]["bf16"] == 327680
    assert report["parameters"] == 70_553_706_496


def test_unknown_architecture_inspects_what_it_can(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 768,
         "num_hidden_layers": 24, "vocab_size": 50280}))
    with CheckpointWriter(tmp_path / "w") as w:  # borrow the writer for a real safetensors file
        w.add("backbone.embeddings.weight", torch.zeros(50280, 4))
        w.write_config({})
    (tmp_path / "w" / "model.safetensors").rename(tmp_path / "model.safetensors")
    report = _inspect(str(tmp_path))
    assert report["architecture"] == "MambaForCausalLM" and report["attention_kind"] is None
    assert report["kv_bytes_per_token"] == {}
    assert report["parameters"] == 50280 * 4 and report["num_hidden_layers"] == 24
    assert any("KV cache size unknown" in n for n in report["notes"])


def test_sliding_window_and_bias_notes(tmp_path):
    config = dict(PRESETS["qwen2.5-7b"]["config"], use_sliding_window=True, max_window_layers=20)
    (tmp_path / "config.json").write_text(json.dumps(config))
    report = _inspect(str(tmp_path / "config.json"))
    assert report["sliding_window"] == 131072
    assert "8 of 28 layers use a sliding window" in report["notes"]
    assert "attention projections have biases" in report["notes"]


def test_corrupt_folder_is_one_line_error(tmp_path, run_main):
    _tiny_llama_folder(tmp_path / "m", tie_word_embeddings=True)
    shard = sorted((tmp_path / "m").glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    code, err = run_main(["inspect", tmp_path / "m"])
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert shard.name in err and "truncated" in err
