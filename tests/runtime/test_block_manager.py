"""BlockManager: paging, prefix caching, LRU eviction, copy-on-write; invariants under random ops."""

from __future__ import annotations

import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from kvconvert.runtime.block_manager import BlockManager


def test_no_torch_import():
    """The block manager is pure bookkeeping: loading it must not import torch."""
    import subprocess
    from pathlib import Path

    module = Path(__file__).resolve().parents[2] / "runtime" / "block_manager.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('bm', {str(module)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['bm'] = m; spec.loader.exec_module(m)\n"
        "sys.exit(int('torch' in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_allocate_grow_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_prefix(1, [1, 2, 3, 4, 5]) == 0
    assert bm.allocate_slots(1, 5, write_from=0) == []
    assert len(bm.block_table(1)) == 2 and bm.num_free_blocks == 6
    assert bm.allocate_slots(1, 9, write_from=5) == []
    assert len(bm.block_table(1)) == 3
    bm.free(1)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocation_fails_cleanly_when_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate_prefix(1, list(range(12)))
    assert bm.allocate_slots(1, 12, write_from=0) is None
    assert bm.block_table(1) == [] and bm.num_free_blocks == 2
    bm.check_invariants()


def _compute(bm, seq_id, tokens, upto):
    start = 0 if not bm.has_table(seq_id) else None
    if start == 0:
        start = bm.allocate_prefix(seq_id, tokens)
    copies = bm.allocate_slots(seq_id, upto, write_from=start)
    bm.commit(seq_id, tokens, upto)
    return start, copies


def test_prefix_hit_shares_full_blocks_only():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = list(range(10))  # 2 full blocks + 2 tokens
    _compute(bm, 1, a, 10)
    cached, _ = _compute(bm, 2, a[:8] + [99, 98, 97], 11)
    assert cached == 8
    assert bm.block_table(2)[:2] == bm.block_table(1)[:2]
    assert bm.block_table(2)[2] != bm.block_table(1)[2]
    assert bm.blocks[bm.block_table(1)[0]].ref_count == 2
    bm.check_invariants()


def test_prefix_chain_requires_same_parents():
    """Same second block after a different first block is a miss (hashes are chained)."""
    bm = BlockManager(num_blocks=16, block_size=2)
    _compute(bm, 1, [1, 2, 3, 4, 5], 5)
    cached, _ = _compute(bm, 2, [9, 9, 3, 4, 5], 5)
    assert cached == 0


@pytest.mark.parametrize("holder_freed", [False, True], ids=["shared", "sole-owner"])
def test_full_hit_recomputes_last_token(holder_freed):
    """A fully cached prompt recomputes its last token (its logits are needed) into its last block:
    into a copy while another sequence holds the block; in place once it is the sole owner, the block
    then no longer served from the prefix cache until recommitted."""
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    _compute(bm, 1, tokens, 8)
    if holder_freed:
        bm.free(1)  # its blocks stay cached
    assert bm.allocate_prefix(2, tokens) == 7
    last = bm.block_table(2)[1]
    copies = bm.allocate_slots(2, 8, write_from=7)
    if holder_freed:
        assert copies == [] and bm.blocks[last].hash is None
        bm.commit(2, tokens, 8)
        assert bm.blocks[last].hash is not None
    else:
        assert copies == [(last, bm.block_table(2)[1])] and bm.block_table(2)[1] != last
        assert bm.blocks[last].ref_count == 1
    bm.check_invariants()


def test_lru_eviction_keeps_recently_used_prefixes():
    bm = BlockManager(num_blocks=4, block_size=2)
    _compute(bm, 1, [1, 1, 1, 1], 4)
    bm.free(1)
    _compute(bm, 2, [2, 2, 2, 2], 4)
    bm.free(2)
    assert bm.num_free_blocks == 4
    # reuse prefix 2 (moves it to most recently used), then a new sequence needs 2 blocks: evicts prefix 1
    assert bm.allocate_prefix(3, [2, 2, 2, 2, 7]) == 4
    bm.allocate_slots(3, 5, write_from=4)
    bm.free(3)
    _compute(bm, 4, [5, 5, 5], 3)
    bm.free(4)
    assert bm.allocate_prefix(5, [2, 2, 2, 2, 0]) == 4
    assert bm.allocate_prefix(6, [1, 1, 1, 1, 0]) == 0
    bm.check_invariants()


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / extend / free sequences against a shadow of what each slot holds.

    Besides the bookkeeping invariants, the shadow proves the paging is *correct*: every computed
    position of every sequence reads back its own token through its block table, whatever was
    shared, copied, evicted or reused.
    """

    @initialize(num_blocks=st.integers(3, 12), block_size=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.seqs: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.memory: dict[int, dict[int, int]] = {}  # block -> offset -> token written
        self.next_id = 0

    def _write(self, seq_id, start, end):
        bs, table, tokens = self.bm.block_size, self.bm.block_table(seq_id), self.seqs[seq_id]
        for p in range(start, end):
            self.memory.setdefault(table[p // bs], {})[p % bs] = tokens[p]

    def _advance(self, seq_id, n):
        start = self.computed[seq_id]
        end = min(start + n, len(self.seqs[seq_id]))
        copies = self.bm.allocate_slots(seq_id, end, write_from=start)
        if copies is None:
            return False
        for src, dst in copies:
            self.memory[dst] = dict(self.memory.get(src, {}))
        self._write(seq_id, start, end)
        self.computed[seq_id] = end
        self.bm.commit(seq_id, self.seqs[seq_id], end)
        return True

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14), n=st.integers(1, 14))
    def add(self, tokens, n):
        seq_id = self.next_id
        self.next_id += 1
        self.seqs[seq_id] = tokens
        self.computed[seq_id] = self.bm.allocate_prefix(seq_id, tokens)
        assert self.computed[seq_id] < len(tokens)
        if not self._advance(seq_id, n):
            self.bm.free(seq_id)
            del self.seqs[seq_id], self.computed[seq_id]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 6), new=st.lists(st.integers(0, 2), max_size=3))
    def extend(self, data, n, new):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        if self.computed[seq_id] == len(self.seqs[seq_id]):
            self.seqs[seq_id] = self.seqs[seq_id] + new  # "generated" tokens
        self._advance(seq_id, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(seq_id)
        del self.seqs[seq_id], self.computed[seq_id]

    @invariant()
    def bookkeeping_is_consistent(self):
        if hasattr(self, "bm"):
            self.bm.check_invariants()

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        if not hasattr(self, "bm"):
            return
        bs = self.bm.block_size
        for seq_id, tokens in self.seqs.items():
            table = self.bm.block_table(seq_id)
            for p in range(self.computed[seq_id]):
                assert self.memory.get(table[p // bs], {}).get(p % bs) == tokens[p], (seq_id, p)


BlockManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_block_manager_random_ops = BlockManagerMachine.TestCase


@pytest.mark.parametrize("bad", [(0, 4), (4, 0)])
def test_rejects_empty_pool(bad):
    with pytest.raises(ValueError):
        BlockManager(*bad)
