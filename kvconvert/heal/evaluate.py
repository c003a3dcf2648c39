"""Measurements used by scripts/bench_heal.py: perplexity and mean next-token KL(source || candidate)
on identical held-out windows, and passkey retrieval accuracy (greedy, plain LongLoRA prompt).

Models are transformers CausalLMs (the source LlamaForCausalLM, candidates DeepseekV3ForCausalLM),
float32 (kvconvert.quant.capture.load_hf_model) on one device, one window at a time
(logits [1, T, V] are the largest temporaries).
"""

from __future__ import annotations

import torch


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def window_metrics(source, candidates: dict, ids: torch.Tensor, progress: bool = False) -> dict:
    """Perplexity of the source and every candidate, and mean KL(source || candidate) per token.

    ids: [N, T] windows; every position but the last predicts the next token (N * (T-1) tokens).
    Returns {"source": {"ppl"}, name: {"ppl", "kl_mean", "ppl_increase_pct"}}.
    """
    from tqdm.auto import tqdm

    from kvconvert.token_stats import TokenSums, window_sums

    sums = {name: TokenSums() for name in ["source", *candidates]}
    for row in tqdm(ids, desc="eval: windows", disable=not progress):
        x = row[None].to(_device_of(source))
        src = source(input_ids=x).logits[0]
        sums["source"] += window_sums(src, row)
        for name, model in candidates.items():
            sums[name] += window_sums(model(input_ids=x.to(_device_of(model))).logits[0], row, src)
    src_ppl = sums["source"].ppl
    out = {"source": {"ppl": src_ppl, "tokens": sums["source"].tokens}}
    for name in candidates:
        out[name] = {"ppl": sums[name].ppl, "kl_mean": sums[name].kl_mean,
                     "ppl_increase_pct": 100 * (sums[name].ppl / src_ppl - 1)}
    return out


def passkey_samples(tokenizer, lengths: tuple[int, ...], per_length: int, seed: int = 0):
    """`per_length` passkey prompts per length, depths evenly spread over [0, 1]."""
    from kvconvert.eval.haystack import passkey_sample

    return [passkey_sample(tokenizer, length, k / max(1, per_length - 1), repeat=0, seed=seed)
            for length in lengths for k in range(per_length)]


@torch.no_grad()
def passkey_accuracy(model, tokenizer, samples) -> dict:
    """{length: accuracy in [0, 1]} by greedy decoding and kvconvert.eval's passkey scorer."""
    from kvconvert.eval.metrics import passkey_score

    hits: dict[int, list[float]] = {}
    for sample in samples:
        ids = torch.tensor([sample.prompt_ids], device=_device_of(model))
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sample.max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        hits.setdefault(sample.meta["length"], []).append(passkey_score(text, sample.answers[0]))
    return {length: sum(v) / len(v) for length, v in hits.items()}
