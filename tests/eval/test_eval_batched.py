"""Task samples run together in the bundled runtime (RuntimeRunner.run_samples: greedy continuations decoded in one
batch, prefix caching on, each answer likelihood scored over its prompt's cached K/V) give each sample what it gets
alone in a fresh engine, on the embedded model (SmolLM2-135M-Instruct, fp32 weights, fp32 cache): passkey and NIAH
prompts of different lengths and depths (they share their haystacks' first blocks). A sample's tokens and answer
likelihood are the suite's results: this is what lets validate run its samples together.

Tolerances: the greedy tokens are identical; the answer NLL (nats summed over the answer) agrees to 1e-5 relative: a
prefix-cache hit reads K/V computed in another pass, whose products ran over another number of rows (fp32 rounding
in the last bits; measured 3e-5 on the logits). In a rounded cache the same last-bit differences move some values
across a rounding boundary, and 4-bit rounding amplifies them: how a prompt is split into prefill chunks moves one
passkey answer's NLL by about 0.5% in bf16, 2% in q8_0 and up to 25% in q5_0/iq4_nl (docs/validate.md, "Batched
samples"), a property of the rounded cache, not of batching; this test pins the batching itself, in fp32."""

import pytest
import torch

from kvconvert.checkpoint import load_tokenizer
from kvconvert.eval import haystack
from kvconvert.eval.runner import LazyRunner, SampleRequest, answer_nll


def _requests(tokenizer) -> list[SampleRequest]:
    samples = [haystack.passkey_sample(tokenizer, length, depth, 0, 7) for length, depth in
               ((256, 0.0), (384, 0.5), (384, 1.0))]
    samples += [haystack.niah_sample(tokenizer, length, depth) for length, depth in ((320, 0.25), (320, 0.75))]
    eos = (tokenizer.eos_token_id,)
    # 10 new tokens keep it short; min_new_tokens masks EOS at the first steps of one of them; the last request
    # wants the answer likelihood alone, another one the continuation alone
    requests = [SampleRequest(tuple(s.prompt_ids), 10, eos + s.stop_ids, 2 if i == 1 else 0, tuple(s.reference_ids))
                for i, s in enumerate(samples)]
    return requests + [SampleRequest(requests[0].prompt, 0, eos, 0, requests[0].reference),
                       SampleRequest(requests[2].prompt, 10, eos)]


def _runner(path, kv_dtype: str) -> LazyRunner:
    runner = LazyRunner(path, "runtime", kv_dtype=kv_dtype, dtype="fp32")
    runner.max_len = 420
    return runner


def test_samples_run_together_get_what_each_gets_alone(smollm2_path):
    kv_dtype = "fp32"
    requests = _requests(load_tokenizer(smollm2_path))
    runner = _runner(smollm2_path, kv_dtype)
    try:
        together = runner.run_samples(requests)
    finally:
        runner.close()
    alone = []
    for r in requests:  # a fresh engine per sample: nothing cached, nothing batched
        one = _runner(smollm2_path, kv_dtype)
        try:
            tokens = one.greedy(torch.tensor(r.prompt), r.max_new_tokens, r.stop_ids, r.min_new_tokens)
            logits = one.logits(torch.tensor(r.prompt + r.reference)) if r.reference else None
        finally:
            one.close()
        alone.append((tokens, None if logits is None else answer_nll(logits[len(r.prompt) - 1: -1], r.reference)))
    assert [t.tokens for t in together] == [tokens for tokens, _ in alone]
    for got, (_, want) in zip(together, alone):
        if want is None:
            assert got.answer is None
        else:
            assert got.answer["tokens"] == want["tokens"]
            assert got.answer["nll"] == pytest.approx(want["nll"], rel=1e-5)
    assert together[5].tokens == [] and all(len(t.tokens) >= 2 for t in together[:5])
    assert not any(set(t.tokens) & set(r.stop_ids) for t, r in zip(together, requests))
