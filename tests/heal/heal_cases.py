"""Tiny real models for the healing tests: a random Llama teacher (with a small BPE tokenizer
trained on the built-in corpus) and its MLA conversion by kvconvert's own converter.

Helpers shared by this folder's tests (fixtures live in conftest.py). A uniquely named module, so
`from heal_cases import ...` resolves to this folder whatever pytest collected first (conftest.py puts
tests/eval, home of the shared tokenizer builder, on sys.path)."""

from __future__ import annotations

from pathlib import Path

import torch
from eval_fixtures import train_tokenizer  # byte-level BPE on 200 KB of the built-in corpus

VOCAB = 384


def build_llama(folder: Path, seed: int = 0, vocab_size: int = VOCAB, layers: int = 2) -> Path:
    """Random Llama (GQA 4 q / 2 kv heads, head_dim 16), weights scaled up so its attention is
    peaked and its next-token distributions far from uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      initializer_range=0.15, tie_word_embeddings=False, rope_theta=10000.0,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(str(folder))
    train_tokenizer(folder, vocab_size)
    return folder


def convert_tiny(teacher: Path, out: Path, text_file: Path, rank: int = 8, rope_dim: int = 8, **options) -> Path:
    """teacher converted by `kvconvert mla` at rank + rope_dim (fp32; options: more MLAOptions, e.g. q_rank)."""
    from kvconvert.mla.convert import MLAOptions, convert_to_mla

    convert_to_mla(teacher, out, MLAOptions(rank=rank, rope_dim=rope_dim, target="any", calib_data=str(text_file),
                                            calib_tokens=1024, calib_window=128, dtype="fp32", **options),
                   progress=False)
    return out


def layerwise_recipe(text_file: Path, **kw) -> dict:
    stage = {"data": str(text_file), "tokens": 2048, "window": 128, "steps": 40, "batch_windows": 4, "lr": 0.01}
    return {"heal_layerwise": {**stage, **kw}}


def distill_recipe(text_file: Path, **kw) -> dict:
    stage = {"data": str(text_file), "tokens": 12 * 2 * 128, "seq_len": 128, "batch_size": 2, "lr": 0.03,
             "warmup_steps": 2, "checkpoint_every": 4}
    return {"heal_distill": {**stage, **kw}}
