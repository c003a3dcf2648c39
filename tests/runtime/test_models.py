"""Runtime models against transformers: same fp32 logits, same greedy tokens.

Tolerance: fp32 logits within 2e-5 absolute (|logits| ~ 1-5): the runtime fuses matmuls, attends
through the paged cache and (MLA decode) uses the absorbed form, all exact in real arithmetic, so
only fp32 rounding differs. Greedy generations must be identical for 64 tokens. The per-layer maths
alone are checked against transformers in tests/models (same variants); this checks the paged-cache
path around them.
"""

from __future__ import annotations

import pytest
import torch

from kvconvert.runtime import LLM, SamplingParams
from runtime_cases import build, greedy, load_reference, model_cases, random_ids, transformers_reference

ATOL = 2e-5

# tests/models' variants, and tied embeddings (the runtime's lm_head when the checkpoint has none)
VARIANTS = {**model_cases.VARIANTS, ("llama", "gqa-tied"): {"tie_word_embeddings": True}}


@pytest.mark.parametrize("arch, variant", sorted(VARIANTS), ids="-".join)
def test_logits_and_greedy_match_transformers(arch, variant, tmp_path):
    path = build(tmp_path / variant, arch, **VARIANTS[arch, variant])
    ids = random_ids(23)
    ref_logits, ref_tokens = transformers_reference(load_reference(path), ids, 64)
    # small blocks and token budget: the prompt is prefilled in 3 chunks across several blocks
    llm = LLM(path, kv_dtype="fp32", block_size=4, max_num_batched_tokens=8)
    torch.testing.assert_close(llm.score(ids), ref_logits, atol=ATOL, rtol=0)
    assert llm.generate([ids], greedy(64))[0].token_ids == ref_tokens


@pytest.mark.slow
def test_smollm2_logits_and_greedy_match_transformers(smollm2_path):
    """The real SmolLM2-135M (embedded default model; loads 540 MB twice): fp32 logits agree within
    2e-4 absolute over 30 layers (|logits| up to ~30), and greedy generation of 64 tokens is identical
    (both stop at EOS if it comes)."""
    from transformers import AutoTokenizer

    prompt = "The history of the printing press begins in"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tokenizer.encode(prompt)
    ref_logits, ref_tokens = transformers_reference(load_reference(smollm2_path), ids, 64)
    llm = LLM(smollm2_path, kv_dtype="fp32", block_size=16, max_num_batched_tokens=4)
    torch.testing.assert_close(llm.score(ids), ref_logits, atol=2e-4, rtol=0)
    out = llm.generate([prompt], SamplingParams(max_tokens=64, greedy=True))[0]
    assert out.prompt_token_ids == ids and out.token_ids == ref_tokens
    assert out.text == tokenizer.decode(ref_tokens, skip_special_tokens=True)


def test_batched_generation_matches_one_at_a_time(tiny_model):
    """Different prompt lengths decoding together give each prompt's solo greedy tokens."""
    prompts = [random_ids(n, seed=n) for n in (5, 17, 9, 30)]
    llm = LLM(tiny_model, kv_dtype="fp32", block_size=4)
    params = greedy(20)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [LLM(tiny_model, kv_dtype="fp32").generate([p], params)[0].token_ids for p in prompts]
    assert together == alone
