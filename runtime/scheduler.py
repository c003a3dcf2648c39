"""Continuous batching: FCFS admission, chunked prefill under a token budget, preemption.

Each step the scheduler hands out at most ``max_num_batched_tokens`` tokens of work:
  1. running sequences first, oldest first: 1 token for a decoding sequence, the next chunk of
     the prompt for one still prefilling;
  2. then waiting sequences in arrival order (no overtaking) while the budget, max_num_seqs and
     the block pool allow.
New requests can be added between any two steps and join the next one.

When a running sequence needs a block and none is free, the youngest running sequence is
preempted by recompute: its blocks are released (its full blocks stay in the prefix cache, so
resuming is mostly cache hits) and it goes back to the front of the queue. The engine never
crashes for lack of blocks: a request that could not fit even alone is rejected when it is added.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvconvert.runtime.block_manager import BlockManager
from kvconvert.runtime.config import EngineConfig
from kvconvert.runtime.sequence import Sequence


@dataclass
class ScheduledSeq:
    """Compute positions [start, start + num_new_tokens) of seq this step."""

    seq: Sequence
    start: int
    num_new_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def needs_sample(self) -> bool:
        """True if this step reaches the last token and another token is wanted."""
        return self.end == self.seq.num_tokens and self.seq.num_generated < self.seq.params.max_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)  # finished with an error at admission


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 vocab_size: int, eos_token_ids: tuple[int, ...] = ()):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._rejected: list[Sequence] = []

    # ------------------------------------------------------------------ admission
    def add(self, seq: Sequence) -> None:
        """Queue seq, or finish it at once with a clear error if it can never run."""
        problem = self._validate(seq)
        if problem is not None:
            seq.finish("error", f"request {seq.seq_id}: {problem}")
            self._rejected.append(seq)
            return
        self.waiting.append(seq)

    def _validate(self, seq: Sequence) -> str | None:
        n, limit = seq.num_prompt_tokens, self.max_model_len
        if n == 0:
            return "empty prompt; give at least one token"
        bad = [t for t in seq.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}); check the tokenizer"
        if n > limit or (n == limit and seq.params.max_tokens > 0):
            return (
                f"prompt has {n} tokens but the model's context is {limit} tokens "
                f"(max_model_len); shorten the prompt to at most {limit - 1} tokens"
            )
        worst = min(n + seq.params.max_tokens, limit)
        need = self.block_manager.blocks_for(worst)
        if need > self.block_manager.num_blocks:
            return (
                f"needs {need} KV blocks ({worst} tokens) but the pool has only "
                f"{self.block_manager.num_blocks}; give more KV memory or lower max_tokens"
            )
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._rejected)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(rejected=self._rejected)
        self._rejected = []
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # blocks are scarce: do not admit new work this step
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            copies = self._allocate(seq, n)
            while copies is None:
                victim = self.running[-1]  # youngest; never one already scheduled this step
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                copies = self._allocate(seq, n)
            if copies is None:
                break
            self._add(out, seq, n, copies)
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not bm.has_table(seq.seq_id):
                # a scoring request: cached below logits_from at most (a hit skips the positions it covers)
                wanted = seq.token_ids[:seq.logits_from + 1] if seq.want_prompt_logits else seq.token_ids
                seq.num_computed_tokens = bm.allocate_prefix(seq.seq_id, wanted)
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = seq.num_computed_tokens
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            copies = self._allocate(seq, n)
            if copies is None:  # wait for blocks; later requests do not overtake (FCFS)
                bm.free(seq.seq_id)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            self._add(out, seq, n, copies)
            budget -= n

    def _allocate(self, seq: Sequence, n: int):
        start = seq.num_computed_tokens
        return self.block_manager.allocate_slots(seq.seq_id, start + n, write_from=start)

    @staticmethod
    def _add(out: SchedulerOutput, seq: Sequence, n: int, copies) -> None:
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
        out.block_copies.extend(copies)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ after the forward
    def update(self, out: SchedulerOutput, next_tokens: dict[int, int]) -> list[Sequence]:
        """Advance the scheduled sequences; next_tokens maps seq_id -> sampled token.

        Returns the sequences that finished this step (their blocks are released).
        """
        finished = []
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.end
            self.block_manager.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # mid-prompt chunk
            if item.needs_sample:
                self._append_token(seq, next_tokens[seq.seq_id])
            else:
                seq.finish("length")  # max_tokens reached (e.g. 0: prefill / scoring only)
            if seq.is_finished:
                self.block_manager.free(seq.seq_id)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        if seq.num_generated == 1:
            seq.first_token_time = time.perf_counter()
        stops = seq.params.stop_token_ids
        if (token in self.eos_token_ids and not seq.params.ignore_eos) or token in stops:
            seq.finish("stop")
        elif seq.num_generated >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish("length")
