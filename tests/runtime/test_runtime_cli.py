"""`kvconvert generate` end to end on a tiny model with a tiny word-level tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from runtime_cases import VOCAB

from kvconvert.commands.main import cli

WORDS = [f"w{i}" for i in range(VOCAB - 1)] + ["[UNK]"]


@pytest.fixture(scope="module")
def model_with_tokenizer(llama_gqa, tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("cli_model")
    for f in llama_gqa.iterdir():
        shutil.copy(f, path / f.name)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


def _run(args):
    return CliRunner().invoke(cli, ["generate", *args], standalone_mode=False, catch_exceptions=True)


def _json(model, *args) -> dict:
    """`kvconvert generate --model model ARGS --json`'s report."""
    result = _run(["--model", str(model), *args, "--json"])
    assert result.exception is None, result.output
    return json.loads(result.output)


def test_generate_json(model_with_tokenizer):
    from kvconvert.runtime import LLM, SamplingParams

    out = _json(model_with_tokenizer, "--prompt", "w1 w2 w3 w4", "--max-new-tokens", "8", "--greedy",
                "--kv-dtype", "fp32", "--kv-memory", "64K")
    expected = LLM(model_with_tokenizer, kv_dtype="fp32").generate(
        ["w1 w2 w3 w4"], SamplingParams(max_tokens=8, greedy=True))[0]
    assert out["token_ids"] == expected.token_ids and len(out["token_ids"]) == 8
    assert out["text"] == " ".join(WORDS[t] for t in expected.token_ids)
    assert out["prompt_tokens"] == 4 and out["timing"]["total_s"] > 0


def test_generate_streams_text(model_with_tokenizer):
    result = _run(["--model", str(model_with_tokenizer), "--prompt", "w5 w6", "--max-new-tokens", "5", "--seed", "3",
                   "--temperature", "0.7", "--top-p", "0.9"])
    assert result.exception is None, result.output
    words = result.output.split()
    assert len(words) == 5 and all(w in WORDS for w in words)


def test_generate_reports_request_errors(model_with_tokenizer):
    from kvconvert.errors import KVConvertError

    long_prompt = " ".join(["w1"] * 300)  # the tiny model's context is 256
    result = _run(["--model", str(model_with_tokenizer), "--prompt", long_prompt])
    assert isinstance(result.exception, KVConvertError) and "context is 256 tokens" in str(result.exception)
    result = _run(["--model", str(model_with_tokenizer), "--prompt", "w1", "--kv-dtype", "fp8"])
    assert isinstance(result.exception, KVConvertError) and "--kv-scales dynamic" in str(result.exception)


def test_generate_dtype_option(model_with_tokenizer):
    """--dtype: auto keeps the stored fp32; bf16 converts; the same greedy tokens on this model."""
    args = ["--prompt", "w1 w2 w3 w4", "--max-new-tokens", "4", "--greedy"]
    outs = {dtype: _json(model_with_tokenizer, *args, "--dtype", dtype) for dtype in ("auto", "bf16")}
    assert outs["auto"]["dtype"] == "float32" and outs["bf16"]["dtype"] == "bfloat16"
    assert len(outs["bf16"]["token_ids"]) == 4


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="auto means cuda on this machine")
def test_generate_device_option(model_with_tokenizer):
    """--device cpu and the default (auto: cpu without a GPU) sample the same tokens (cuda without a
    GPU: tests/runtime/test_device.py)."""
    args = ["--prompt", "w1 w2 w3", "--max-new-tokens", "5", "--seed", "3"]
    outs = [_json(model_with_tokenizer, *args, *extra) for extra in ([], ["--device", "cpu"])]
    assert outs[0]["device"] == outs[1]["device"] == "cpu" and outs[0]["token_ids"] == outs[1]["token_ids"]
