"""Runtime models against transformers: same fp32 logits, same greedy tokens.

Tolerance: fp32 logits within 2e-5 absolute (|logits| ~ 1-5): the runtime fuses matmuls, attends
through the paged cache and (MLA decode) uses the absorbed form, all exact in real arithmetic, so
only fp32 rounding differs. Greedy generations must be identical for 64 tokens.
"""

from __future__ import annotations

import pytest
import torch
from runtime_cases import VOCAB, build_deepseek, build_llama, load_reference
from kvconvert.runtime import LLM, SamplingParams
from kvconvert.runtime.layers import rope_inv_freq, rope_parameters, yarn_softmax_scale

ATOL = 2e-5
GREEDY = SamplingParams(max_tokens=64, greedy=True, ignore_eos=True)

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


def _prompt(n=23, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_match_transformers(variant, tmp_path):
    path = VARIANTS[variant](tmp_path / variant)
    ref = load_reference(path)
    prompt = _prompt()
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt])).logits[0]
        ref_tokens = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
    # small blocks and token budget: the prompt is prefilled in 3 chunks across several blocks
    llm = LLM(path, kv_dtype="fp32", block_size=4, max_num_batched_tokens=8)
    torch.testing.assert_close(llm.score(prompt), ref_logits, atol=ATOL, rtol=0)
    assert llm.generate([prompt], GREEDY)[0].token_ids == ref_tokens


def test_batched_generation_matches_one_at_a_time(tiny_model):
    """Different prompt lengths decoding together give each prompt's solo greedy tokens."""
    prompts = [_prompt(n, seed=n) for n in (5, 17, 9, 30)]
    llm = LLM(tiny_model, kv_dtype="fp32", block_size=4)
    params = SamplingParams(max_tokens=20, greedy=True, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [LLM(tiny_model, kv_dtype="fp32").generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


# ---------------------------------------------------------------------------------- RoPE
def _hf_inv_freq(config_cls, **kw):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = config_cls(**kw)
    return ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, "cpu")


@pytest.mark.parametrize("rope", [LLAMA3, YARN, {**YARN, "factor": None, "mscale": None, "truncate": False}],
                         ids=["llama3", "yarn", "yarn-no-factor"])
def test_rope_frequencies_match_transformers(rope):
    from transformers import LlamaConfig

    kw = {"hidden_size": 64, "num_attention_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
          "rope_parameters": dict(rope)}
    hf_freq, hf_factor = _hf_inv_freq(LlamaConfig, **kw)
    ours, factor = rope_inv_freq(32, rope_parameters({"max_position_embeddings": 256, "rope_parameters": dict(rope)}), 256)
    torch.testing.assert_close(ours, hf_freq, atol=0, rtol=0)
    assert factor == pytest.approx(hf_factor, rel=1e-12)


def test_legacy_rope_scaling_keys_are_read():
    params = rope_parameters({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0},
                              "max_position_embeddings": 64})
    assert params["rope_type"] == "linear" and params["rope_theta"] == 5e5
    freq, _ = rope_inv_freq(8, params, 64)
    torch.testing.assert_close(freq, 0.5 / (5e5 ** (torch.arange(0, 8, 2).float() / 8)))


def test_yarn_softmax_scale_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    assert yarn_softmax_scale(YARN, 32 ** -0.5) == pytest.approx(yarn_apply_mscale(YARN, 32 ** -0.5), rel=1e-12)
    assert yarn_softmax_scale(YARN, 32 ** -0.5) != 32 ** -0.5


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "longrope"}])
def test_unsupported_rope_is_a_clear_error(rope):
    from kvconvert.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="not supported"):
        rope_parameters({"rope_parameters": rope, "max_position_embeddings": 64})
