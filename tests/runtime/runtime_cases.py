"""Tiny random Llama / DeepSeek-V3 checkpoints built with transformers (fast, no network).

Helpers shared by this folder's tests (fixtures live in conftest.py). A uniquely named module, so
`from runtime_cases import ...` resolves to this folder whatever pytest collected first."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvconvert.runtime import SamplingParams

VOCAB = 96


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


def _perturb_norms(model, seed: int) -> None:
    """Random RMSNorm weights (transformers initialises them to 1, which would hide norm bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))


def _save_random(path, model_cls, config, seed: int):
    model = model_cls(config).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(path)
    return path


def _common_config(layers: int, rope, bias: bool) -> dict:
    """What every tiny model shares: vocab VOCAB, hidden 64, MLP 96, 256 positions, no special tokens."""
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                max_position_embeddings=256, rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
                attention_bias=bias, initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build_llama(path, *, heads=4, kv_heads=2, tie=True, rope=None, bias=False, seed=0, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, tie_word_embeddings=tie,
                      mlp_bias=bias, **_common_config(layers, rope, bias))
    return _save_random(path, LlamaForCausalLM, cfg, seed)


def build_deepseek(path, *, interleave=True, q_lora_rank=None, rope=None, bias=False, seed=0, layers=2,
                   kv_lora_rank=32):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, first_k_dense_replace=layers, n_routed_experts=4,
        tie_word_embeddings=False, rope_interleave=interleave, **_common_config(layers, rope, bias))
    return _save_random(path, DeepseekV3ForCausalLM, cfg, seed)


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


SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ on sys.path while it loads, for its sibling imports)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))
