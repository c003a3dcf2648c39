"""What a generation task hands to a model: a prompt as token ids, a budget, a way to score.

A `GenSample` is fully determined by the suite, the seed and the tokenizer, so source and
candidate see identical token ids, and its `content_hash` changes whenever the prompt or the
decoding budget does (cached results of an older prompt are never reused).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GenSample:
    """One greedy-generation test case.

    task: family/name, e.g. "passkey", "niah", "ruler/vt", "longbench/hotpotqa".
    sample_id: unique within the task. prompt_ids: token ids fed to both models.
    max_new_tokens: decoding budget. stop_ids: extra stop tokens (the models' EOS ids always stop).
    min_new_tokens: steps at which stop tokens are masked out (LongBench's min_length for samsum).
    answers: gold strings the scorer compares against. reference_ids: the reference answer as token ids
    that continue the prompt (at most max_new_tokens of them), whose likelihood both models score
    teacher-forced (answer_nll); empty = the task has none (RULER). meta: plotting/grouping data
    (length, depth, all_classes, ...), JSON-serializable.
    """

    task: str
    sample_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    answers: tuple[str, ...]
    stop_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    reference_ids: tuple[int, ...] = ()
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError(f"{self.task}/{self.sample_id}: empty prompt")
        if self.max_new_tokens <= 0:
            raise ValueError(f"{self.task}/{self.sample_id}: max_new_tokens must be positive")

    @property
    def content_hash(self) -> str:
        fields = [list(self.prompt_ids), self.max_new_tokens, list(self.stop_ids), self.min_new_tokens]
        if self.min_new_tokens:  # the runtime decodes forced tokens in the engine now (min_tokens), no longer by a
            fields.append("min_tokens in the engine")  # second prefill: results of the old way are recomputed
        payload = json.dumps(fields)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    @property
    def answer_hash(self) -> str:
        """Names the teacher-forced answer scoring: the prompt and the reference ids (not the decoding budget,
        so a changed budget keeps the answer scores and a changed reference recomputes them)."""
        payload = json.dumps([list(self.prompt_ids), list(self.reference_ids)])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class EssayWindow:
    """One perplexity / KL window: ids [T] int64 of the essays, its positions scored_from.. T - 1 scored (row t
    predicts token t + 1). scored_from > 0: a long window whose scored tokens come after the cache holds
    scored_from others. key: the content hash that names its cached results and stored logits."""

    ids: object  # torch.Tensor [T] (samples.py stays torch-free)
    scored_from: int = 0

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def rows(self) -> int:
        """Logit rows kept per model: T - scored_from."""
        return len(self.ids) - self.scored_from

    @property
    def key(self) -> str:
        from kvconvert.data import data_hash  # imported here: samples.py stays torch-free

        content = data_hash(self.ids)
        return content if not self.scored_from else f"{content}-from{self.scored_from}"
