"""Builders shared by the eval tests (and tests/faults): a tiny trained BPE tokenizer, tiny random
Llamas, synthetic validate reports."""

from __future__ import annotations

import shutil

import torch


def gen_records(source: list[float], candidate: list[float]) -> list[dict]:
    """Generation-task records with these source and candidate scores."""
    return [{"id": str(i), "source": {"score": s}, "candidate": {"score": c}} for i, (s, c) in
            enumerate(zip(source, candidate))]


def make_report(samples: dict, version: int | None = None) -> dict:
    """A validate report of these per-task records (quick suite, RULER skipped)."""
    from kvconvert.eval.report import build_report
    from kvconvert.eval.suites import SUITE_VERSION

    header = {"suite": {"name": "quick", "version": version or SUITE_VERSION},
              "skipped": {"ruler": "the quick suite does not run RULER"}}
    return build_report(header, samples)


def train_tokenizer(folder, vocab_size: int = 512, chars: int = 200_000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvconvert.data import pydoc_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([pydoc_corpus()[:chars]], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(folder))
    return fast


def _save(model, folder, tokenizer_dir):
    """save_pretrained into `folder`, plus the tokenizer files of `tokenizer_dir` when given."""
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer_dir is not None else ():
        shutil.copy2(tokenizer_dir / name, folder / name)
    return folder


def save_tiny_llama(folder, vocab_size: int, seed: int = 0, tokenizer_dir=None, max_positions: int = 1024):
    """A 2-layer random Llama (GQA 4/2 heads, hidden 64) saved with save_pretrained (+ tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         eos_token_id=0, bos_token_id=0, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(config), folder, tokenizer_dir)


def save_tiny_deepseek(folder, vocab_size: int, seed: int = 0, tokenizer_dir=None):
    """A 2-layer random DeepSeek-V3 (MLA: latent 32, rope 16, all layers dense) via save_pretrained."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=2, max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=0,
        bos_token_id=0, rope_interleave=True)
    return _save(DeepseekV3ForCausalLM(config), folder, tokenizer_dir)
