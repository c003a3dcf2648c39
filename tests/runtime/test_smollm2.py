"""The real SmolLM2-135M (embedded default model): runtime vs transformers (slow: loads 540 MB twice).

fp32 logits agree within 2e-4 absolute over a 30-layer model (|logits| up to ~30), and greedy
generation of 64 tokens is identical (both stop at EOS if it comes).
"""

from __future__ import annotations

import pytest
import torch
from kvconvert.runtime import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The history of the printing press begins in"


@pytest.fixture(scope="module")
def reference(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_path)


def test_smollm2_logits_and_greedy_match_transformers(smollm2_path, reference):
    model, tokenizer = reference
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref_logits = model(torch.tensor([ids])).logits[0]
        ref_tokens = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
    llm = LLM(smollm2_path, kv_dtype="fp32", block_size=16, max_num_batched_tokens=4)
    torch.testing.assert_close(llm.score(ids), ref_logits, atol=2e-4, rtol=0)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=64, greedy=True))[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids == ref_tokens
    assert out.text == tokenizer.decode(ref_tokens, skip_special_tokens=True)
