"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, prefix caching.

Pure Python (no torch): it decides *which* physical block holds which token; kv_cache.py holds
the bytes. Token position p of a sequence lives in block ``table[p // block_size]`` at offset
``p % block_size``, i.e. cache slot ``table[p // block_size] * block_size + p % block_size``.

Every block is in exactly one state:
  * free        ref_count 0, no hash            (in ``_free``, reused first)
  * cached      ref_count 0, hash registered    (in ``_evictable``, LRU order, reusable on a hit)
  * in use      ref_count > 0 (number of block tables that list it), hash optional

Prefix caching (nano-vllm style): once a block is full *and its KV has been computed* its content
hash ``hash((parent_hash, token_ids))`` is registered, chained to the previous block's hash, so a
hit on block i implies the whole prefix matches. A hit is verified against the stored token ids
and parent hash, so a hash collision can only cause a miss, never wrong KV.

Copy-on-write: a block listed by more than one table (or registered in the prefix cache) is never
written in place; ``allocate_slots`` returns (src, dst) block copies for the cache to perform
first, then the writer owns a private block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

ROOT_HASH = 0  # parent hash of a sequence's first block


def block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Content hash of a full block, chained to its parent's hash (deterministic for ints)."""
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # registered prefix-cache hash, or None
    token_ids: tuple[int, ...] | None = None  # content of a registered block (hit verification)
    parent_hash: int | None = None


class BlockManager:
    """Allocates blocks to sequences (by integer id) and keeps the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._hash_to_block: dict[int, int] = {}
        self._tables: dict[int, list[int]] = {}
        # content hashes of each sequence's leading full, computed blocks (those commit() has seen)
        self._seq_hashes: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free + cached-but-unreferenced)."""
        return len(self._free) + len(self._evictable)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def has_table(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _chunks(self, token_ids, num_full: int):
        bs = self.block_size
        return [tuple(token_ids[i * bs:(i + 1) * bs]) for i in range(num_full)]

    def _lookup(self, token_ids) -> tuple[list[int], list[int]]:
        """Longest chain of registered blocks matching the full blocks of token_ids: (ids, hashes)."""
        ids, hashes, parent = [], [], ROOT_HASH
        if not self.enable_prefix_caching:
            return ids, hashes
        for chunk in self._chunks(token_ids, len(token_ids) // self.block_size):
            h = block_hash(parent, chunk)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.parent_hash != parent:
                break  # hash collision: treat as a miss
            ids.append(block_id)
            hashes.append(h)
            parent = h
        return ids, hashes

    # ------------------------------------------------------------------ allocation
    def allocate_prefix(self, seq_id: int, token_ids) -> int:
        """Start a block table for seq_id from the prefix cache; returns the number of cached tokens.

        At least one token is always left to compute (the engine needs its logits), so a fully
        cached sequence reports len(token_ids) - 1: its last token is recomputed and written into
        the last (shared) block, which allocate_slots then copies first.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        ids, hashes = self._lookup(token_ids)
        for block_id in ids:
            self._ref(block_id)
        self._tables[seq_id] = list(ids)
        self._seq_hashes[seq_id] = list(hashes)
        return max(0, min(len(ids) * self.block_size, len(token_ids) - 1))

    def allocate_slots(self, seq_id: int, num_tokens: int, write_from: int) -> list[tuple[int, int]] | None:
        """Cover positions [0, num_tokens) and make those in [write_from, num_tokens) writable.

        Returns the (src, dst) block copies the cache must perform before writing, or None (and
        changes nothing) when the pool has too few blocks.
        """
        table = self._tables.get(seq_id, [])
        needed = self.blocks_for(num_tokens)
        rewritten = range(write_from // self.block_size, min(len(table), needed))  # blocks it has that get writes
        shared = sum(1 for i in rewritten if self.blocks[table[i]].ref_count > 1)  # each one copied on write
        if max(0, needed - len(table)) + shared > self.num_free_blocks:
            return None
        self._tables[seq_id] = table
        self._seq_hashes.setdefault(seq_id, [])
        copies = [copy for i in rewritten if (copy := self._make_writable(seq_id, i)) is not None]
        table.extend(self._take() for _ in range(needed - len(table)))
        return copies

    def _make_writable(self, seq_id: int, index: int) -> tuple[int, int] | None:
        table = self._tables[seq_id]
        block = self.blocks[table[index]]
        hashes = self._seq_hashes[seq_id]
        del hashes[index:]  # commit() re-registers this block and the ones after it
        if block.ref_count > 1:  # shared: copy on write
            new_id = self._take()
            block.ref_count -= 1
            table[index] = new_id
            return block.block_id, new_id
        if block.hash is not None:  # private but registered: its content is about to change
            self._unregister(block)
        return None

    def commit(self, seq_id: int, token_ids, num_computed: int) -> None:
        """Register the prefix-cache hashes of blocks that are now full and computed."""
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        table, hashes = self._tables[seq_id], self._seq_hashes[seq_id]
        num_full = min(num_computed // self.block_size, len(table))
        start = len(hashes)
        if start >= num_full:
            return
        parent = hashes[-1] if hashes else ROOT_HASH
        for i, chunk in enumerate(self._chunks(token_ids, num_full)[start:], start):
            h = block_hash(parent, chunk)
            hashes.append(h)
            block = self.blocks[table[i]]
            if block.hash is None and h not in self._hash_to_block:
                block.hash, block.token_ids, block.parent_hash = h, chunk, parent
                self._hash_to_block[h] = block.block_id
            parent = h

    def free(self, seq_id: int) -> None:
        """Drop seq_id's table. Tail blocks are released first so LRU evicts them first."""
        table = self._tables.pop(seq_id, [])
        self._seq_hashes.pop(seq_id, None)
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    # ------------------------------------------------------------------ internals
    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def _take(self) -> int:
        """A block for exclusive use: a free one, else evict the least recently used cached one."""
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._unregister(self.blocks[block_id])
        else:
            raise RuntimeError("block pool exhausted (callers must check num_free_blocks)")
        self.blocks[block_id].ref_count = 1
        return block_id

    def _unregister(self, block: Block) -> None:
        if block.hash is not None and self._hash_to_block.get(block.hash) == block.block_id:
            del self._hash_to_block[block.hash]
        block.hash = block.token_ids = block.parent_hash = None

    # ------------------------------------------------------------------ invariants (tests)
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for block_id in table:
                refs[block_id] += 1
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, "a block is both free and cached"
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref_count != table references"
            in_pool = block.block_id in free or block.block_id in evictable
            assert in_pool == (block.ref_count == 0), f"block {block.block_id}: referenced and free, or leaked"
            if block.block_id in free:
                assert block.hash is None, f"free block {block.block_id} still has a hash"
            if block.block_id in evictable:
                assert block.hash is not None, f"cached block {block.block_id} has no hash"
            if block.hash is not None:
                assert self._hash_to_block.get(block.hash) == block.block_id, "hash table out of sync"
                assert block.hash == block_hash(block.parent_hash, block.token_ids), "stale block hash"
        for h, block_id in self._hash_to_block.items():
            assert self.blocks[block_id].hash == h, "hash maps to a block with another hash"
        for seq_id, table in self._tables.items():
            assert len(self._seq_hashes[seq_id]) <= len(table), "more hashes than blocks"
