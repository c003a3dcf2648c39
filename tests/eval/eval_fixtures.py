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


def save_tiny_model(folder, vocab_size: int, seed: int = 0, tokenizer_dir=None, arch: str = "llama"):
    """A 2-layer random model (hidden 64, 4 heads) saved with save_pretrained, plus the tokenizer files
    of `tokenizer_dir` when given. arch "llama": GQA with 2 KV heads; "deepseek_v3": MLA (latent 32,
    rope 16), every layer dense."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=1024, eos_token_id=0, bos_token_id=0,
                  tie_word_embeddings=False)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **common))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            moe_intermediate_size=32, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=2, rope_interleave=True, **common))
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer_dir is not None else ():
        shutil.copy2(tokenizer_dir / name, folder / name)
    return folder
