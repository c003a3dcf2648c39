"""One request's state as it moves through the engine: waiting -> running -> finished (the scheduler's
queue holding it says which of the first two; finish() sets the last)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvconvert.runtime.config import SamplingParams


@dataclass(eq=False)
class Sequence:
    """A prompt and the tokens generated for it.

    token_ids = prompt + generated tokens. num_computed_tokens = how many leading tokens have their
    KV in the paged cache (prefix-cache hits count). The last token is computed one step after it
    is sampled, so a decoding sequence has exactly one token left to compute.
    want_prompt_logits: keep the logits of the prompt positions from logits_from on (LLM.score); such a
    request takes prefix-cache hits only below logits_from, since a hit skips the positions it covers.
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    want_prompt_logits: bool = False
    logits_from: int = 0
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: str | None = None
    num_cached_tokens: int = 0  # prefix-cache hit on first admission
    num_preemptions: int = 0
    prompt_logits: list = field(default_factory=list)  # chunks of [n, vocab] fp32, in order
    next_logit_pos: int = field(init=False)  # the first prompt position whose logits are not kept yet
    generator: object = None  # torch.Generator for seeded sampling
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self):
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.token_ids = list(self.prompt_token_ids)
        if not 0 <= self.logits_from < max(self.num_prompt_tokens, 1):
            raise ValueError(f"logits_from {self.logits_from} is outside the {self.num_prompt_tokens}-token prompt")
        self.next_logit_pos = self.logits_from

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    def banned_tokens(self, eos_token_ids) -> tuple[int, ...]:
        """Token ids its next sample may not take: the stop ids and (without ignore_eos) the EOS ids while
        fewer than params.min_tokens tokens were generated, else none."""
        if self.num_generated >= self.params.min_tokens:
            return ()
        eos = () if self.params.ignore_eos else tuple(eos_token_ids)
        return tuple(dict.fromkeys(self.params.stop_token_ids + eos))

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.perf_counter()
