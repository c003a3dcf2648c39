"""Tiny random Llama (GQA) and DeepSeek-V3 (MLA) checkpoints with a word-level tokenizer, built offline.

Helpers shared by this folder's tests (fixtures live in conftest.py). A uniquely named module, so
`from quant_cases import ...` resolves to this folder whatever pytest collected first."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import torch

WORDS_FILE_TOKENS = 4000  # words in the tiny calibration text file


def _word_tokenizer(folder: Path, vocab_size: int) -> list[str]:
    """Word-level tokenizer over the most common words of Python's pydoc topics; saved to folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvconvert.data import pydoc_corpus

    words = re.findall(r"\w+|[^\w\s]", pydoc_corpus())
    vocab = ["<unk>"] + [w for w, _ in Counter(words).most_common(vocab_size - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    return vocab


def _save(model, folder: Path, vocab_size: int) -> Path:
    model.save_pretrained(folder)
    _word_tokenizer(folder, vocab_size)
    return folder


def make_llama(folder: Path, seed: int = 0, vocab_size: int = 512, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, head_dim: int = 16, bias: bool = False) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=512, attention_bias=bias, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # make K/V magnitudes uneven across channels, like real models
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(torch.rand(kv_heads * head_dim, 1) * 4)
            layer.self_attn.v_proj.weight.mul_(torch.rand(kv_heads * head_dim, 1) * 4)
    return _save(model, folder, vocab_size)


def make_deepseek(folder: Path, seed: int = 0, vocab_size: int = 512, layers: int = 2,
                  rope_interleave: bool = True, kv_lora_rank: int = 32, rope_dim: int = 16) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                           kv_lora_rank=kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=rope_dim, qk_nope_head_dim=16,
                           v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                           first_k_dense_replace=layers, max_position_embeddings=512,
                           rope_interleave=rope_interleave, tie_word_embeddings=False)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a non-uniform latent norm weight: rotation must fold it first
        for layer in model.model.layers:
            layer.self_attn.kv_a_layernorm.weight.copy_(0.5 + torch.rand(kv_lora_rank))
    return _save(model, folder, vocab_size)


def assert_same_logits(model_dir: Path, reference_dir: Path, tokens: int = 32) -> None:
    """fp32 logits of two checkpoints agree on random ids (exact rewrites: rotations, scale folding)."""
    from kvconvert.quant.capture import load_hf_model

    ids = torch.randint(0, 512, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_hf_model(model_dir)(input_ids=ids).logits,
                                   load_hf_model(reference_dir)(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
