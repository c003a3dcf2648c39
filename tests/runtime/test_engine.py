"""Engine behaviour: paging, prefix caching, copy-on-write, preemption, continuous batching,
sampling and per-request errors. Paged results are compared with an unpaged run (one block as
long as the context) in fp32: logits within 2e-5, greedy tokens identical."""

from __future__ import annotations

import pytest
import torch

from kvconvert.errors import KVConvertError, UnsupportedModelError
from kvconvert.runtime import LLM, SamplingParams
from kvconvert.runtime.model_runner import top_p_filter
from runtime_cases import VOCAB, add_tensors, greedy, random_ids

ATOL = 2e-5
MAX_LEN = 256  # the tiny models' max_position_embeddings


def _contiguous(path, **kw):
    """Unpaged reference: every sequence gets one block as long as the model's context."""
    return LLM(path, kv_dtype="fp32", block_size=MAX_LEN, enable_prefix_caching=False, **kw)


def test_paged_equals_contiguous(tiny_model):
    prompts = [random_ids(n, seed=n) for n in (3, 19, 40)]
    paged = LLM(tiny_model, kv_dtype="fp32", block_size=4, max_num_batched_tokens=16)
    flat = _contiguous(tiny_model)
    torch.testing.assert_close(paged.score(prompts[2]), flat.score(prompts[2]), atol=ATOL, rtol=0)
    assert [o.token_ids for o in paged.generate(prompts, greedy())] == \
        [o.token_ids for o in flat.generate(prompts, greedy())]


def test_prefix_cache_hit_equals_miss(tiny_model):
    shared = random_ids(24, seed=1)
    prompts = [shared + random_ids(5, seed=2), shared, shared[:13]]
    llm = LLM(tiny_model, kv_dtype="fp32", block_size=4)
    first = llm.generate([shared], greedy())[0]
    assert first.num_cached_tokens == 0
    hits = llm.generate(prompts, greedy())
    assert [o.num_cached_tokens for o in hits] == [24, 23, 12]  # full hit recomputes its last token
    misses = _contiguous(tiny_model).generate(prompts, greedy())
    assert [o.token_ids for o in hits] == [o.token_ids for o in misses]
    assert hits[1].token_ids == first.token_ids


def test_copy_on_write_of_a_block_shared_with_a_running_sequence(deepseek_mla):
    """B arrives while A decodes; B's prompt is all cached in A's blocks, so B recomputes its last
    token into a copy of the shared block instead of overwriting A's."""
    prompt = random_ids(8, seed=3)  # two full blocks of 4
    llm = LLM(deepseek_mla, kv_dtype="fp32", block_size=4)
    a = llm.add_request(prompt, greedy(12))
    llm.step()  # A prefilled, its blocks registered
    copies_seen = []
    schedule = llm.scheduler.schedule

    def recording_schedule():
        out = schedule()
        copies_seen.extend(out.block_copies)
        return out

    llm.scheduler.schedule = recording_schedule
    b = llm.add_request(prompt, greedy(12))
    while llm.has_unfinished():
        llm.step()
    assert copies_seen, "the shared last block was not copied"
    ref = _contiguous(deepseek_mla).generate([prompt], greedy(12))[0].token_ids
    out_a, out_b = llm.take_output(a), llm.take_output(b)
    assert out_a.token_ids == ref and out_b.token_ids == ref
    assert out_b.num_cached_tokens == 7 and llm.take_output(b) is None


def test_preemption_by_recompute_gives_the_same_tokens(tiny_model):
    prompts = [random_ids(n, seed=10 + n) for n in (9, 14, 11, 6)]
    params = greedy(24)
    # 12 blocks of 4 = 48 slots for 4 requests of up to 38 tokens: must preempt to finish
    small = LLM(tiny_model, kv_dtype="fp32", block_size=4, num_blocks=12)
    outs = small.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0
    assert all(o.error is None for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _contiguous(tiny_model).generate(prompts, params)]
    small.block_manager.check_invariants()
    assert small.block_manager.num_free_blocks == 12


def test_scored_request_survives_preemption(deepseek_mla):
    """Prompt logits of a preempted scoring request are recomputed, not duplicated."""
    llm = LLM(deepseek_mla, kv_dtype="fp32", block_size=4, num_blocks=10, max_num_batched_tokens=8)
    llm.add_request(random_ids(20, seed=4), greedy(16))  # older: keeps its blocks
    llm.step()
    prompt = random_ids(30, seed=5)
    rid = llm.add_request(prompt, SamplingParams(max_tokens=0), want_prompt_logits=True)
    while llm.has_unfinished():
        llm.step()
    scored = llm._finished[rid]
    assert scored.num_preemptions > 0
    logits = torch.cat(scored.prompt_logits)
    assert logits.shape == (30, VOCAB)
    torch.testing.assert_close(logits, _contiguous(deepseek_mla).score(prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("cached", [False, True])
def test_score_from_a_position_reads_the_prefix_from_the_cache(tiny_model, cached):
    """score(ids, logits_from=k): the logits of positions k.. only; with the prompt's first blocks cached (a
    generation of the prefix ran before), those positions are hits and not computed again, the logits equal."""
    ids = random_ids(30, seed=8)
    llm = LLM(tiny_model, kv_dtype="fp32", block_size=4)
    if cached:
        llm.generate([ids[:21]], greedy(3))
    rid = llm.add_request(ids, SamplingParams(max_tokens=0), want_prompt_logits=True, logits_from=20)
    while llm.has_unfinished():
        llm.step()
    seq = llm._finished[rid]
    assert seq.num_cached_tokens == (20 if cached else 0)
    rows = llm.take_scores(rid)
    assert rows.shape == (10, VOCAB)
    torch.testing.assert_close(rows, _contiguous(tiny_model).score(ids)[20:], atol=ATOL, rtol=0)
    with pytest.raises(KVConvertError, match="logits_from 30 is outside the 30-token prompt"):
        llm.score(ids, logits_from=30)


def test_continuous_batching_new_requests_join_between_steps(tiny_model):
    llm = LLM(tiny_model, kv_dtype="fp32", block_size=4)
    first = llm.add_request(random_ids(10, seed=6), greedy(20))
    for _ in range(5):
        llm.step()
    second = llm.add_request(random_ids(7, seed=7), greedy(20))
    batch_sizes = []
    while llm.has_unfinished():
        batch_sizes.append(len(llm.scheduler.running))
        llm.step()
    assert max(batch_sizes) == 2  # the late request decoded alongside the first
    ref = _contiguous(tiny_model).generate([random_ids(10, seed=6), random_ids(7, seed=7)], greedy(20))
    assert llm.take_output(first).token_ids == ref[0].token_ids
    assert llm.take_output(second).token_ids == ref[1].token_ids


def test_bad_requests_fail_alone(tiny_model):
    llm = LLM(tiny_model, kv_dtype="fp32", block_size=4, num_blocks=16)
    good = random_ids(6, seed=8)
    outs = llm.generate(
        [good, [], random_ids(MAX_LEN, seed=9), [VOCAB + 5], random_ids(40, seed=10), good],
        [greedy(), greedy(), greedy(), greedy(), SamplingParams(max_tokens=100), greedy()],
    )
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "error", "length"]
    assert "empty prompt" in outs[1].error
    assert "context is 256 tokens" in outs[2].error
    assert "outside the vocabulary" in outs[3].error
    assert "KV blocks" in outs[4].error and "pool has only 16" in outs[4].error
    assert outs[0].token_ids == outs[5].token_ids and len(outs[0].token_ids) == 16


def test_generation_stops_at_the_context_limit(llama_gqa):
    llm = LLM(llama_gqa, kv_dtype="fp32", max_model_len=20)
    out = llm.generate([random_ids(15)], greedy(50))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_tokens_and_eos(tmp_path, llama_gqa):
    prompt = random_ids(8)
    free = LLM(llama_gqa, kv_dtype="fp32").generate([prompt], greedy(20))[0].token_ids
    stop = free[5]
    cut = free.index(stop) + 1
    out = LLM(llama_gqa, kv_dtype="fp32").generate([prompt], SamplingParams(max_tokens=20, greedy=True,
                                                                            stop_token_ids=(stop,)))[0]
    assert out.token_ids == free[:cut] and out.finish_reason == "stop"
    with_eos = add_tensors(llama_gqa, tmp_path / "eos", {}, {"eos_token_id": stop})
    out = LLM(with_eos, kv_dtype="fp32").generate([prompt], SamplingParams(max_tokens=20, greedy=True))[0]
    assert out.token_ids == free[:cut] and out.finish_reason == "stop"


def test_min_tokens_masks_stop_ids_and_eos_for_the_first_tokens(tmp_path, llama_gqa):
    """vLLM's min_tokens: stop ids and EOS cannot be sampled before min_tokens tokens; the masked first token
    is the argmax of the prompt's last logits over the other ids (computed here from LLM.score)."""
    prompt = random_ids(8)
    llm = LLM(llama_gqa, kv_dtype="fp32")
    first = llm.generate([prompt], greedy(1))[0].token_ids[0]
    logits = llm.score(prompt)[-1]
    logits[first] = float("-inf")
    expected = int(logits.argmax())
    for extra in ({"stop_token_ids": (first,)}, {}):  # as a stop id, and as the model's EOS
        model = llama_gqa if extra else add_tensors(llama_gqa, tmp_path / "eos", {}, {"eos_token_id": first})
        out = LLM(model, kv_dtype="fp32").generate([prompt], SamplingParams(max_tokens=6, min_tokens=1, greedy=True,
                                                                            **extra))[0]
        assert out.token_ids[0] == expected
        assert len(out.token_ids) == 6 or out.token_ids[-1] == first  # after min_tokens it stops as usual
        unmasked = LLM(model, kv_dtype="fp32").generate([prompt], SamplingParams(max_tokens=6, greedy=True, **extra))[0]
        assert unmasked.token_ids == [first] and unmasked.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_model):
    p = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    llm = LLM(tiny_model, kv_dtype="fp32")
    alone = llm.generate([random_ids(9)], p)[0].token_ids
    crowd = llm.generate([random_ids(5, seed=1), random_ids(9), random_ids(12, seed=2)],
                         [SamplingParams(max_tokens=12, temperature=1.0), p, SamplingParams(max_tokens=3)])
    assert crowd[1].token_ids == alone
    other_seed = llm.generate([random_ids(9)], SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=99,
                                                           ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_tiny_top_p_isgreedy(tiny_model):
    llm = LLM(tiny_model, kv_dtype="fp32")
    argmax = llm.generate([random_ids(9)], greedy(10))[0].token_ids
    tiny_top_p = SamplingParams(max_tokens=10, top_p=1e-6, ignore_eos=True)
    assert llm.generate([random_ids(9)], tiny_top_p)[0].token_ids == argmax


def test_top_p_filter_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.1, 0.5, 0.25, 0.15])
    torch.testing.assert_close(top_p_filter(probs.clone(), 0.7), torch.tensor([0.0, 0.5, 0.25, 0.0]) / 0.75)
    torch.testing.assert_close(top_p_filter(probs.clone(), 0.5), torch.tensor([0.0, 1.0, 0.0, 0.0]))


# ---------------------------------------------------------------------------------- bad models / configs
@pytest.mark.parametrize("arch, config, match", [
    ("llama", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "gpt2"),
    ("deepseek", {"first_k_dense_replace": 1}, "MoE"),
])
def test_unsupported_models_are_refused(llama_gqa, deepseek_mla, tmp_path, arch, config, match):
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(add_tensors(llama_gqa if arch == "llama" else deepseek_mla, tmp_path / "bad", {}, config))


@pytest.mark.parametrize("kw, match", [
    ({"kv_dtype": "int4"}, "kv_dtype"),
    ({"attention_backend": "cuda"}, "backend"),
    ({"block_size": 0}, "block_size"),
    ({"num_blocks": 4, "kv_memory": 1 << 20}, "not both"),
    ({"kv_memory": 10}, "holds no block"),
    ({"max_model_len": 100000}, "max_position_embeddings"),
])
def test_bad_engine_settings(llama_gqa, kw, match):
    with pytest.raises(KVConvertError, match=match):
        LLM(llama_gqa, **kw)


def test_bad_sampling_params():
    for kw in ({"temperature": -1.0}, {"top_p": 0.0}, {"max_tokens": -1}, {"seed": -3}, {"min_tokens": -1},
               {"max_tokens": 2, "min_tokens": 3}):
        with pytest.raises(KVConvertError):
            SamplingParams(**kw)


def test_default_pool_fits_the_default_batch(llama_gqa):
    llm = LLM(llama_gqa)
    assert llm.num_blocks == 64 * (MAX_LEN // 16)  # capped at max_num_seqs full-length requests
    assert llm.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # layers x (k, v) x kv_heads x head_dim x bf16
