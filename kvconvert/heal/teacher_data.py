"""Healing data written by the teacher itself (recipe `data: teacher`).

The built-in corpus (Python's pydoc) is far from the prose people serve: a student healed on it
ends close to the teacher on pydoc and still far from it on English text (docs/heal.md). With no
network and no training prose on the machine, the teacher is the best source of in-distribution
text: sample continuations of short, generic English openings and heal on them (self-distillation
data, as in data-free QAT). The samples are cached next to the teacher's fingerprint, so a rerun or
a resumed heal reads the same text and the data hash in the manifest stays stable.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from kvconvert.checkpoint import atomic_write_text
from kvconvert.errors import KVConvertError

# Generic openings across registers (narrative, essay, explanation, news, dialogue). The teacher
# continues each; no evaluation text (essays, LongBench, passkey filler) is used here.
OPENINGS = (
    "Once upon a time", "I have been thinking about", "The history of", "In this essay I want to argue that",
    "Here is how", "Scientists recently discovered", "When I was young,", "The most important thing about",
    "Dear friend,", "There are three reasons why", "Yesterday, the city council", "Learning to cook",
    "The economy of", "My favorite book", "It is often said that", "A good teacher",
    "The problem with", "In the summer of", "Most people believe", "The first step in starting a company is",
    "Climate change", "She opened the door and", "The difference between", "Why do we",
)
GENERATOR_VERSION = 3


def fingerprint(*parts) -> str:
    """16 hex digits of the sha256 of the parts' JSON (a heal run's and a teacher sample's identity)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def teacher_text_cache(teacher: Path, num_tokens: int, seed: int, device: str = "cpu") -> Path:
    """Where the samples for (teacher weights, size, seed, device kind) are cached, under
    $KVCONVERT_HOME. The device is part of the key: sampling on a GPU draws other random numbers
    (and batches differently), so its text differs from the CPU's for the same seed."""
    from kvconvert.checkpoint import CheckpointReader
    from kvconvert.resources import kvconvert_home

    reader = CheckpointReader(teacher, verify=False)
    kind = torch.device(device).type
    key = fingerprint({"v": GENERATOR_VERSION, "config": reader.config, "bytes": reader.total_bytes,
                       "tokens": num_tokens, "seed": seed, **({} if kind == "cpu" else {"device": kind})})
    return kvconvert_home() / "teacher-text" / f"{key}.txt"


def sample_teacher_text(teacher: str | Path, num_tokens: int, seed: int = 0, batch_size: int | None = None,
                        new_tokens: int = 512, progress: bool = True, device: str = "cpu") -> str:
    """About `num_tokens` tokens of text sampled from `teacher` (temperature 1, top-p 0.95).

    Sequences of `new_tokens` continue OPENINGS in turn; each sample is its opening plus the
    continuation, samples joined by blank lines. Cached (see teacher_text_cache); a broken or
    missing teacher raises before anything is generated. batch_size: sequences per generate()
    call (default 32 on the CPU, 256 on a GPU, where generation is launch-bound at small batches).
    """
    if num_tokens < 1:
        raise KVConvertError(f"teacher data: need a positive number of tokens, got {num_tokens}")
    teacher = Path(teacher)
    cache = teacher_text_cache(teacher, num_tokens, seed, device)
    if cache.is_file():
        with open(cache, encoding="utf-8", newline="") as f:  # newline="": keep any \r the model wrote
            return f.read()
    from tqdm.auto import tqdm

    from kvconvert.checkpoint import load_tokenizer
    from kvconvert.quant.capture import load_hf_model

    tok = load_tokenizer(teacher)
    model = load_hf_model(teacher).to(device)
    if batch_size is None:
        batch_size = 32 if torch.device(device).type == "cpu" else 256
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    gen = torch.Generator().manual_seed(seed)
    samples, made, k = [], 0, 0
    bar = tqdm(total=num_tokens, desc="heal: teacher writes its data", unit="tok", disable=not progress)
    while made < num_tokens:
        prompts = [OPENINGS[(k + i) % len(OPENINGS)] for i in range(batch_size)]
        k += batch_size
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # generate() has no generator arg
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            # EOS suppressed: every row runs the full length (an instruct model would stop after a
            # few sentences and leave most of the batch as padding), like concatenated documents.
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=0.95, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
        for prompt, row in zip(prompts, out[:, enc.input_ids.shape[1]:]):
            # the continuation's first token carries its own leading space (or punctuation)
            samples.append((prompt + tok.decode(row, skip_special_tokens=True)).strip())
            made += int((row != tok.pad_token_id).sum())
        bar.update(min(made, num_tokens) - bar.n)
    bar.close()
    text = "\n\n".join(samples)
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cache, text)  # a killed run never leaves a short cache behind
    return text
