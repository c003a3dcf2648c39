"""Tiny random Llama / DeepSeek-V3 checkpoints built with transformers (fast, no network).

Helpers shared by this folder's tests (fixtures live in conftest.py). A uniquely named module, so
`from runtime_cases import ...` resolves to this folder whatever pytest collected first. The tiny
models are tests/models' (model_cases: configs, variants, random norms), saved as checkpoints."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvconvert.runtime import SamplingParams

TESTS = Path(__file__).resolve().parents[1]
SCRIPTS = TESTS.parent / "scripts"


def load_module(folder: Path, name: str):
    """Module `name` from folder (on sys.path while it loads, for its sibling imports)."""
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


def load_script(name: str):
    """scripts/<name>.py as a module."""
    return load_module(SCRIPTS, name)


model_cases = load_module(TESTS / "models", "model_cases")
VOCAB = model_cases.VOCAB
# no special tokens: no EOS ends a generation early
NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def build(path, arch: str, **config):
    """A tiny random checkpoint at path: model_cases' `arch` ("llama", "deepseek_v3") with the config changes."""
    model, _ = model_cases.build(arch, **{**NO_SPECIAL_TOKENS, **config})
    model.save_pretrained(path)
    return path


def random_ids(n: int, seed: int = 0) -> list[int]:
    """n random token ids of the tiny models' vocabulary (seeded)."""
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int = 16) -> SamplingParams:
    """n greedy tokens, past any EOS."""
    return SamplingParams(max_tokens=n, greedy=True, ignore_eos=True)


def assert_bf16_logits_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 activations against fp32 ones, same (bf16) weights. Tolerances (measured: max |dlogit|
    0.19 at a logit std of 1.2, mean KL 3e-4, greedy agreement 97-98% on these random models): the
    difference is bf16 rounding of activations only; RMSNorm statistics, softmax, the final norm
    and the logits themselves are fp32 in both."""
    assert float((got - ref).abs().max()) < 0.3 * float(ref.std())
    lr, lg = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lr.exp() * (lr - lg)).sum(-1)
    assert float(kl.mean()) < 2e-3 and float(kl.max()) < 2e-2
    assert float((ref.argmax(-1) == got.argmax(-1)).float().mean()) >= 0.9


def add_tensors(src, dst, extra: dict[str, torch.Tensor], config_update: dict | None = None,
                dtype: torch.dtype | None = None):
    """Copy a single-file checkpoint to dst with extra tensors (e.g. KV scales) and config keys,
    its tensors converted to dtype if given."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: v if dtype is None else v.to(dtype) for k, v in load_file(src / "model.safetensors").items()}
    tensors.update(extra)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.update(config_update or {})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def load_reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()



def transformers_reference(model, ids: list[int], n_new: int, make_cache=lambda: None):
    """transformers' fp32 logits [T, vocab] of ids and its n_new greedy tokens, each run with a fresh
    make_cache() as its cache (None: transformers' own)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x, past_key_values=make_cache(), use_cache=True).logits[0]
        tokens = model.generate(x, past_key_values=make_cache(), max_new_tokens=n_new, do_sample=False)
    return logits, tokens[0, len(ids):].tolist()
