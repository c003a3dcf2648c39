"""The one architecture registry (kvconvert/models/registry.py): every list of supported
architectures derives from it, and Mistral (Llama's maths, no sliding window) is accepted by the
converter, calibration and the runtime alike, giving exactly what the same weights give as Llama."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "quant")]
from quant_cases import make_llama  # noqa: E402

from kvconvert.errors import UnsupportedModelError  # noqa: E402
from kvconvert.models.registry import ARCHITECTURES, SOURCE_MODEL_TYPES, TARGET_MODEL_TYPE, architecture  # noqa: E402

TINY_CAL = ["--kv-dtype", "fp8", "--observer", "amax", "--calib-tokens", "256", "--window-len", "64",
            "--batch-size", "2", "--quiet", "--threads", "1"]
TINY_MLA = ["--rank", "16", "--target", "any", "--calib-tokens", "512", "--calib-window", "128", "--dtype", "fp32"]


def as_mistral(llama: Path, folder: Path, **config) -> Path:
    """The same weights and tokenizer declared as Mistral (v0.3 style: sliding_window null)."""
    shutil.copytree(llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None, **config)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("registry")
    llama = make_llama(root / "llama")
    return llama, as_mistral(llama, root / "mistral")


def test_every_supported_list_derives_from_the_registry():
    from kvconvert.mla.deepseek_format import SUPPORTED_MODEL_TYPES
    from kvconvert.runtime.models import MODELS

    assert set(MODELS) == set(ARCHITECTURES)
    assert SUPPORTED_MODEL_TYPES == SOURCE_MODEL_TYPES == {"llama", "mistral"}
    assert TARGET_MODEL_TYPE == "deepseek_v3"
    for kind, (module, cls) in MODELS.items():  # every runner named there exists
        import importlib

        assert hasattr(importlib.import_module(module), cls), kind


def test_lookup_by_model_type_or_class_and_a_clear_refusal():
    assert architecture({"model_type": "mistral"}).maths == "llama"
    assert architecture({"architectures": ["LlamaForCausalLM"]}).model_type == "llama"
    with pytest.raises(UnsupportedModelError, match=r"model_type 'qwen2'.*supported: llama \(LlamaForCausalLM\)"):
        architecture({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})


def test_transformers_computes_mistral_as_llama(pair):
    """The premise of sharing Llama's maths: transformers' own Mistral class gives Llama's logits."""
    from transformers import AutoModelForCausalLM

    llama, mistral = pair
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
        b = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32)
        assert type(b).__name__ == "MistralForCausalLM"
        torch.testing.assert_close(b(ids).logits, a(ids).logits, rtol=0, atol=1e-6)


def test_generate_runs_mistral_as_llama(pair, capsys):
    from kvconvert.commands.main import main

    tokens = []
    for model in pair:
        main(["generate", "--model", str(model), "--prompt", "the function", "--greedy", "--max-new-tokens", "6",
              "--json", "--device", "cpu"])
        tokens.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert tokens[0] == tokens[1] and len(tokens[0]) > 0


def test_mla_and_calibrate_treat_mistral_as_llama(pair, run_main, tmp_path):
    """Same weights, same calibration text: the conversion and the calibrated scales are identical."""
    outs = {}
    for name, src in zip(("llama", "mistral"), pair):
        code, err = run_main(["mla", "--src", src, *TINY_MLA, "--device", "cpu", "--out", tmp_path / f"{name}-mla"])
        assert code == 0, err
        code, err = run_main(["calibrate", "--src", src, *TINY_CAL, "--out", tmp_path / f"{name}-fp8"])
        assert code == 0, err
        outs[name] = name
    for kind in ("mla", "fp8"):
        a = load_file(tmp_path / f"llama-{kind}" / "model.safetensors")
        b = load_file(tmp_path / f"mistral-{kind}" / "model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=key)
    assert json.loads((tmp_path / "mistral-mla" / "config.json").read_text())["model_type"] == "deepseek_v3"


def test_mistral_with_a_window_shorter_than_the_context_is_refused(pair, run_main, tmp_path):
    windowed = as_mistral(pair[0], tmp_path / "windowed")
    cfg = json.loads((windowed / "config.json").read_text())
    cfg["sliding_window"] = 128  # < max_position_embeddings 512: drops tokens
    (windowed / "config.json").write_text(json.dumps(cfg))
    for argv in (["generate", "--model", windowed, "--prompt", "x", "--max-new-tokens", "1"],
                 ["mla", "--src", windowed, *TINY_MLA, "--out", tmp_path / "o1"],
                 ["calibrate", "--src", windowed, *TINY_CAL, "--out", tmp_path / "o2"]):
        code, err = run_main(argv)
        assert code == 2 and "sliding-window attention" in err, (argv[0], err)
