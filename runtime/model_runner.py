"""Turns a scheduled step into tensors, runs the model over the paged cache, and samples.

A step is flat: the scheduled sequences' new tokens are concatenated, decode sequences (one token)
first, then prefill chunks. For each token: its id, its position, and its cache slot
``block_table[pos // block_size] * block_size + pos % block_size``. They are built on the host
and copied to the cache's device once per step; sampling draws from host generators (so a seed
gives the same tokens on every device for the same logits).
"""

from __future__ import annotations

import torch

from kvconvert.runtime.attention import AttentionMetadata, PrefillChunk, length_mask
from kvconvert.runtime.block_manager import BlockManager
from kvconvert.runtime.kv_cache import PagedKVCache
from kvconvert.runtime.scheduler import ScheduledSeq, SchedulerOutput
from kvconvert.runtime.sequence import Sequence


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, block_manager: BlockManager, attention,
                 eos_token_ids: tuple[int, ...] = ()):
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids)  # masked with the stop ids before min_tokens (SamplingParams)
        self.cache = cache
        self.block_manager = block_manager
        self.attention = attention
        self.block_size = block_manager.block_size
        self.device = cache.device
        self.default_generator = torch.Generator().manual_seed(torch.initial_seed() % (2**63))

    # ---------------------------------------------------------------- inputs
    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prepare(self, items: list[ScheduledSeq]):
        """-> input_ids [T], positions [T], AttentionMetadata, all on the cache's device.
        items: decode items first."""
        bs = self.block_size
        decode = [it for it in items if it.num_new_tokens == 1]
        ids, positions, slots, prefills = [], [], [], []
        for it in items:
            table = self.block_manager.block_table(it.seq.seq_id)
            ids += it.seq.token_ids[it.start: it.end]
            positions += range(it.start, it.end)
            slots += [table[pos // bs] * bs + pos % bs for pos in range(it.start, it.end)]
            if it.num_new_tokens != 1:
                n_blocks = self.block_manager.blocks_for(it.end)
                prefills.append(PrefillChunk(len(ids) - it.num_new_tokens, it.num_new_tokens, it.end,
                                             self._tensor(table[:n_blocks])))
        lens = [it.end for it in decode]
        longest = max(lens, default=0)
        lens_t = self._tensor(lens)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_size=bs,
            num_decode=len(decode),
            decode_block_tables=self._padded_tables([it.seq.seq_id for it in decode], lens),
            decode_context_lens=lens_t,
            prefills=prefills,
            decode_max_len=longest,
            decode_mask=None if all(n == longest for n in lens) else length_mask(lens_t, longest)[:, None, None, :],
        )
        return self._tensor(ids), self._tensor(positions), meta

    def _padded_tables(self, seq_ids: list[int], context_lens: list[int]) -> torch.Tensor:
        """[B, max_blocks] block tables, padded with block 0 (masked out by context length)."""
        if not seq_ids:
            return torch.zeros(0, 1, dtype=torch.long, device=self.device)
        needed = [self.block_manager.blocks_for(n) for n in context_lens]
        width = max(needed)
        rows = [self.block_manager.block_table(s)[:n] + [0] * (width - n) for s, n in zip(seq_ids, needed)]
        return self._tensor(rows)

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> dict[int, int]:
        """Execute one scheduled step; returns {seq_id: next token} for sequences that sample."""
        self.cache.copy_blocks(out.block_copies)
        items = sorted(out.scheduled, key=lambda it: it.num_new_tokens != 1)  # decode first (stable)
        input_ids, positions, meta = self.prepare(items)
        hidden = self.model.forward(input_ids, positions, self.cache, meta, self.attention)
        rows, sampled, scored = self._logit_rows(items)
        if not rows:
            return {}
        logits = self.model.logits(hidden[self._tensor(rows)])
        for it, lo, hi, first in scored:
            self._keep_prompt_logits(it, logits[lo:hi], first)
        seqs = [it.seq for it, _ in sampled]
        picked = mask_banned(logits[[row for _, row in sampled]], seqs, self.eos_token_ids)
        tokens = sample(picked, seqs, self.default_generator)
        return {it.seq.seq_id: tok for (it, _), tok in zip(sampled, tokens)}

    def _logit_rows(self, items):
        """Rows of hidden to project: last row of each sampling sequence, the rows of scored ones from their
        logits_from on.

        Returns (hidden rows, [(item, index into logits)], [(item, lo, hi, first position) logits slices]).
        """
        rows, sampled, scored, offset = [], [], [], 0
        for it in items:
            first = max(it.start, it.seq.logits_from) if it.seq.want_prompt_logits else it.end
            if first < it.end:  # ends with the chunk's last row
                scored.append((it, len(rows), len(rows) + it.end - first, first))
                rows.extend(range(offset + first - it.start, offset + it.num_new_tokens))
            if it.needs_sample:
                if first == it.end:
                    rows.append(offset + it.num_new_tokens - 1)
                sampled.append((it, len(rows) - 1))
            offset += it.num_new_tokens
        return rows, sampled, scored

    @staticmethod
    def _keep_prompt_logits(it: ScheduledSeq, logits: torch.Tensor, first: int) -> None:
        """Append the logits of prompt positions not kept yet (a preempted sequence recomputes some).
        logits: rows of positions [first, it.end)."""
        seq = it.seq
        lo = max(seq.next_logit_pos, first)
        hi = min(it.end, seq.num_prompt_tokens)
        if hi > lo:
            seq.prompt_logits.append(logits[lo - first:hi - first].to("cpu", copy=True))  # kept on the host
            seq.next_logit_pos = hi


# ------------------------------------------------------------------------------ sampling
def mask_banned(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """logits [N, vocab] (a copy the caller owns) with each sequence's banned ids (Sequence.banned_tokens:
    stop/EOS ids before min_tokens) set to -inf, in place."""
    for i, seq in enumerate(seqs):
        banned = seq.banned_tokens(eos_token_ids)
        if banned:
            logits[i, list(banned)] = float("-inf")
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> list[int]:
    """logits [N, vocab] fp32 (any device) -> one token per sequence, by its SamplingParams.

    greedy: argmax. Otherwise softmax(logits / temperature), restricted to the top-p nucleus (the
    most likely tokens until their total probability reaches top_p, at least one), renormalized,
    and drawn with the sequence's own generator (seeded requests) or the engine's.
    """
    if not seqs:
        return []
    greedy = logits.argmax(dim=-1).tolist()
    tokens = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.is_greedy:
            tokens.append(greedy[i])
            continue
        probs = torch.softmax(logits[i].cpu() / p.temperature, dim=-1)  # host generators draw on the host
        if p.top_p < 1.0:
            probs = top_p_filter(probs, p.top_p)
        gen = seq.generator if seq.generator is not None else default_generator
        tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    return tokens


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [vocab] -> renormalized probs over the smallest prefix (by descending probability)
    whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()
