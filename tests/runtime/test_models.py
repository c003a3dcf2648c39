"""Runtime models against transformers: same fp32 logits, same greedy tokens.

Tolerance: fp32 logits within 2e-5 absolute (|logits| ~ 1-5): the runtime fuses matmuls, attends
through the paged cache and (MLA decode) uses the absorbed form, all exact in real arithmetic, so
only fp32 rounding differs. Greedy generations must be identical for 64 tokens. The per-layer maths alone are checked against
transformers in tests/models; this checks the paged-cache path around them.
"""

from __future__ import annotations

import pytest
import torch
from runtime_cases import build_deepseek, build_llama, greedy, load_reference, random_ids
from kvconvert.runtime import LLM

ATOL = 2e-5

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

VARIANTS = {
    "llama-gqa-tied": lambda p: build_llama(p),
    "llama-mha-untied-llama3-bias": lambda p: build_llama(p, heads=4, kv_heads=4, tie=False, rope=LLAMA3, bias=True),
    "deepseek-interleave": lambda p: build_deepseek(p, interleave=True),
    "deepseek-qlora-yarn-bias-no-interleave": lambda p: build_deepseek(
        p, interleave=False, q_lora_rank=24, rope=YARN, bias=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_match_transformers(variant, tmp_path):
    path = VARIANTS[variant](tmp_path / variant)
    ref = load_reference(path)
    ids = random_ids(23)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
        ref_tokens = ref.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
    # small blocks and token budget: the prompt is prefilled in 3 chunks across several blocks
    llm = LLM(path, kv_dtype="fp32", block_size=4, max_num_batched_tokens=8)
    torch.testing.assert_close(llm.score(ids), ref_logits, atol=ATOL, rtol=0)
    assert llm.generate([ids], greedy(64))[0].token_ids == ref_tokens


def test_batched_generation_matches_one_at_a_time(tiny_model):
    """Different prompt lengths decoding together give each prompt's solo greedy tokens."""
    prompts = [random_ids(n, seed=n) for n in (5, 17, 9, 30)]
    llm = LLM(tiny_model, kv_dtype="fp32", block_size=4)
    params = greedy(20)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [LLM(tiny_model, kv_dtype="fp32").generate([p], params)[0].token_ids for p in prompts]
    assert together == alone
