"""GGUF import: the embedded SmolLM2 (imported once by the smollm2_path fixture) is a clean,
loadable HF Llama folder; a broken GGUF fails in one line and leaves nothing behind."""

from __future__ import annotations

import json

import pytest
import torch

from kvconvert.checkpoint import CheckpointReader, verify_manifest
from kvconvert.checkpoint.gguf_import import import_gguf
from kvconvert.errors import CheckpointError, OutputExistsError


@pytest.mark.slow
def test_imported_config_is_plain_llama(smollm2_path):
    config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (30, 576, 9, 3, 64)
    assert config["tie_word_embeddings"] is True
    assert not any(k.startswith("_name_or_path") for k in config)
    reader = CheckpointReader(smollm2_path)
    assert "lm_head.weight" not in reader  # tied: written once
    assert reader.get("model.embed_tokens.weight").dtype == torch.float32
    assert verify_manifest(smollm2_path) == []


@pytest.mark.slow
def test_transformers_loads_the_import_and_gives_finite_logits(smollm2_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = LlamaForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert ids[0, 0].item() != tokenizer.bos_token_id  # SmolLM2's tokenizer adds no BOS (transformers 5.x)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # re-tied on load
    # a working language model, not noise: " Paris" is among the top 5 next tokens
    top5 = logits[0, -1].topk(5).indices.tolist()
    assert tokenizer.encode(" Paris", add_special_tokens=False)[0] in top5


def test_corrupt_gguf_is_one_line_error_and_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 60)
    with pytest.raises(CheckpointError) as exc:
        import_gguf(bad, tmp_path / "out")
    assert "bad.gguf" in str(exc.value) and "\n" not in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


@pytest.mark.parametrize("existing_out, error, match", [(False, CheckpointError, "not found"),
                                                       (True, OutputExistsError, "--overwrite")])
def test_missing_gguf_or_existing_output_refused(tmp_path, existing_out, error, match):
    if existing_out:
        (tmp_path / "out").mkdir()  # refused before the GGUF is even looked at
    with pytest.raises(error, match=match):
        import_gguf(tmp_path / "none.gguf", tmp_path / "out")
