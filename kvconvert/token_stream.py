"""Token windows streamed from text sources (kvconvert.text_sources): tokenized on the fly, packed into
fixed windows, mixed by weight, shuffled in blocks, split between processes, prefetched by a
background thread, and resumable exactly. Memory is bounded by one block and the prefetch queue,
whatever the size of the corpus.

The global sequence of windows is a pure function of the sources, the tokenizer, the window length
and the seed, never of the number of processes:

  Packer        one source's documents -> token ids, the tokenizer's EOS after each document ->
                consecutive windows; an epoch's last partial window is dropped
  WindowStream  the mix: window i comes from the source whose count lags its weight most (smooth
                weighted round robin: exact shares, A B A B for two equal ones); windows are grouped
                in blocks of BLOCK_WINDOWS, each permuted by a generator seeded with (seed, block
                number). A single source ends its block at an epoch's end, so data smaller than a block
                is one permutation per epoch, every window once
  Batches       process r of W takes micro-batches g = r, r + W, ... (windows g*b .. g*b + b - 1), so
                W processes with batch b see the same windows per step as one with batch b x W; a
                thread fills a bounded queue (tokenization never runs on the training thread)

Resume: a block's start state (each packer's document cursor, its not-yet-windowed tokens, the mix's
counts) is small; position() saves the state of the block holding the last window consumed and the
index of the next one, and a restart rebuilds that block and skips to it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import numpy as np
import torch

from kvconvert.errors import KVConvertError
from kvconvert.text_sources import TextSource, documents

BLOCK_WINDOWS = 1024  # windows shuffled together (8 MB of int32 at 2048 tokens)
TOKENIZE_CHARS = 1 << 18  # documents tokenized per call, by characters
PREFETCH_BATCHES = 8  # micro-batches queued ahead of the training loop


class DataExhausted(KVConvertError):
    """A source ran out of whole windows after max_epochs passes."""


def separator_ids(tokenizer) -> list[int]:
    """What goes after each document: the tokenizer's EOS, or a blank line's ids when it has none."""
    if tokenizer.eos_token_id is not None:
        return [int(tokenizer.eos_token_id)]
    return list(tokenizer("\n\n", add_special_tokens=False).input_ids)


class Packer:
    """One source's windows of `window` tokens, in order, epoch after epoch (restart())."""

    def __init__(self, source: TextSource, tokenizer, window: int, state: dict | None = None):
        self.source, self.tokenizer, self.window = source, tokenizer, window
        self.sep = np.asarray(separator_ids(tokenizer), dtype=np.int32)
        state = state or {}
        self.epoch, self.made = state.get("epoch", 0), state.get("made", 0)
        self.cursor = state.get("cursor")
        carry = state.get("carry")
        self.buffer = np.asarray(carry.numpy() if carry is not None else [], dtype=np.int32)
        self.docs = documents(source, self.cursor)

    def state(self) -> dict:
        """Where to restart for the same windows again (the cursor after the last document read, and the
        tokens read but not yet windowed)."""
        return {"epoch": self.epoch, "made": self.made, "cursor": self.cursor,
                "carry": torch.from_numpy(self.buffer.copy())}

    def next_window(self) -> np.ndarray | None:
        """The next window, or None at the end of this epoch."""
        while self.buffer.size < self.window:
            if not self._read():
                return None
        out, self.buffer = self.buffer[: self.window], self.buffer[self.window:]
        self.made += 1
        return out

    def restart(self) -> None:
        """The next epoch, from the source's start (the last partial window dropped)."""
        self.epoch, self.made, self.cursor = self.epoch + 1, 0, None
        self.buffer = np.zeros(0, dtype=np.int32)
        self.docs = documents(self.source, None)

    def _read(self) -> bool:
        """Tokenize the next documents (about TOKENIZE_CHARS characters) onto the buffer."""
        texts, ends, size = [], [], 0
        for doc in self.docs:
            texts.append(doc.text)
            ends.append(doc.ends)
            self.cursor = doc.cursor
            size += len(doc.text)
            if size >= TOKENIZE_CHARS:
                break
        if not texts:
            return False
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        parts = [self.buffer]
        for row, end in zip(ids, ends):
            parts.append(np.asarray(row, dtype=np.int32))
            if end:
                parts.append(self.sep)
        self.buffer = np.concatenate(parts)
        return True


class WindowStream:
    """The global sequence of windows of a weighted mix of sources (see the module docstring). limit:
    the windows a run reads in all (the stream ends there, so no block reads past what the run needs)."""

    def __init__(self, sources: list[tuple[TextSource, float]], tokenizer, window: int, seed: int = 0,
                 max_epochs: int = 1, shuffle: bool = True, block: int = BLOCK_WINDOWS, limit: int | None = None):
        self.sources, self.tokenizer, self.window = sources, tokenizer, window
        self.seed, self.max_epochs, self.shuffle, self.block, self.limit = seed, max_epochs, shuffle, block, limit
        self.weights = np.asarray([w for _, w in sources], dtype=np.float64)

    def describe(self) -> dict:
        return {"sources": [{**s.describe(), "weight": round(w, 6)} for s, w in self.sources],
                "window": self.window, "seed": self.seed, "block": self.block if self.shuffle else 0}

    def blocks(self, state: dict | None = None) -> Iterator[tuple[int, dict, Iterator[np.ndarray]]]:
        """(index of the block's first window, the block's start state, its windows): permuted when
        shuffling, else produced as they are read. Each block's windows must be read before the next."""
        state = state or {}
        packers = [Packer(s, self.tokenizer, self.window, st)
                   for (s, _), st in zip(self.sources, state.get("packers", [None] * len(self.sources)))]
        counts = np.asarray(state.get("counts", [0] * len(self.sources)), dtype=np.int64)
        start, number = state.get("index", 0), state.get("block", 0)
        while self.limit is None or start < self.limit:
            start_state = {"index": start, "block": number, "counts": counts.tolist(),
                           "packers": [p.state() for p in packers]}
            made = [0]
            rows = self._rows(packers, counts, self._block_size(start), made)
            if self.shuffle:
                windows = np.stack(list(rows))
                rows = iter(windows[block_order(len(windows), self.seed, number).numpy()])
            yield start, start_state, rows
            start, number = start + made[0], number + 1

    def _block_size(self, start: int) -> int:
        """Windows in the block starting at `start`. One source: up to BLOCK_WINDOWS, the run's limit and the
        epoch's end, so data smaller than both is one permutation of all its windows per epoch, the last
        epoch read whole and cut at the limit (the order the distiller had before streaming). A mix: never
        past the limit (reading ahead could run a small source out)."""
        if self.limit is None:
            return self.block
        return min(self.block, self.limit if len(self.sources) == 1 else self.limit - start)

    def _rows(self, packers: list[Packer], counts: np.ndarray, size: int, made: list[int]) -> Iterator[np.ndarray]:
        """Up to `size` windows of the mix (fewer when a single source's epoch ends); counts them in made[0]."""
        while made[0] < size:
            k = int(np.argmax(self.weights * (counts.sum() + 1) - counts))  # the most lagging share
            w = packers[k].next_window()
            if w is None:
                if len(packers) == 1 and made[0]:  # one source: a block never spans two epochs
                    return
                self._next_epoch(packers[k])
                w = packers[k].next_window()
                if w is None:
                    raise self._exhausted(packers[k], 0)
            counts[k] += 1
            made[0] += 1
            yield w

    def _next_epoch(self, packer: Packer) -> None:
        if packer.epoch + 1 >= self.max_epochs:
            raise self._exhausted(packer, packer.made)
        packer.restart()

    def _exhausted(self, packer: Packer, made: int) -> DataExhausted:
        return DataExhausted(
            f"data too short: {packer.source.name} holds {made} whole {self.window}-token windows "
            f"({made * self.window} tokens), read {self.max_epochs} time(s) (max_epochs); use more data, fewer "
            "tokens or a larger max_epochs")

    def windows_from(self, position: dict | None = None) -> Iterator[tuple[int, np.ndarray, dict]]:
        """(global index, window, its block's start state) from `position` (Batches.position) on."""
        skip = position["index"] if position else 0
        for start, state, rows in self.blocks(position["block_state"] if position else None):
            for j, window in enumerate(rows):
                if self.limit is not None and start + j >= self.limit:
                    return
                if start + j >= skip:
                    yield start + j, window, state


def block_order(n: int, seed: int, number: int) -> torch.Tensor:
    """The seeded permutation of block `number` (of epoch `number` for data held whole)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + number))


class TensorWindows:
    """Windows held in memory ([N, T] ids): epoch after epoch, each a seeded permutation of all N (the
    distiller's order before streaming; tests and benchmarks hand it tensors)."""

    def __init__(self, ids: torch.Tensor, seed: int = 0):
        self.ids, self.seed = ids, seed
        self.window = ids.shape[1]

    def windows_from(self, position: dict | None = None) -> Iterator[tuple[int, np.ndarray, None]]:
        i = position["index"] if position else 0
        n = self.ids.shape[0]
        while True:
            epoch, j = divmod(i, n)
            perm = block_order(n, self.seed, epoch)
            for k in range(j, n):
                yield i, self.ids[perm[k]].numpy(), None
                i += 1


class Batches:
    """This process's micro-batches of a window sequence ([batch, T] int64 tensors), produced by a
    background thread into a queue of at most `depth` batches. `wait_s`: time the consumer blocked."""

    def __init__(self, stream, batch_size: int, rank: int = 0, world: int = 1, depth: int = PREFETCH_BATCHES):
        self.stream, self.batch_size, self.rank, self.world, self.depth = stream, batch_size, rank, world, depth
        self.start_position: dict | None = None
        self.last_block: dict | None = None  # start state of the block of the last window consumed
        self.marked: dict | None = None  # last_block when mark() was called (a step's end)
        self.wait_s = 0.0
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def seek(self, position: dict | None) -> None:
        """Start (lazily, at the next get) from a saved position; None: the beginning."""
        self.close()
        self.start_position = position
        self.last_block = self.marked = (position or {}).get("block_state")

    def mark(self) -> None:
        """Every process has consumed the same windows (an optimizer step's end): position() refers here."""
        self.marked = self.last_block

    def position(self, next_index: int) -> dict:
        """The state to save at the last mark(), when every process has consumed the windows before
        `next_index`: the start state of a block at or before it, and the index itself."""
        return {"index": next_index, "block_state": self.marked}

    def get(self) -> torch.Tensor:
        if self._thread is None:
            self._start()
        t0 = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            self._thread = None
            raise item
        batch, self.last_block = item
        return batch

    def close(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)  # unblock a producer waiting on a full queue
            except queue.Empty:
                pass
        self._thread, self._queue = None, None

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._produce, args=(self._stop, self._queue), daemon=True,
                                        name="kvconvert-data")
        self._thread.start()

    def _produce(self, stop: threading.Event, out: queue.Queue) -> None:
        b, rows, state = self.batch_size, [], None
        try:
            for i, window, block in self.stream.windows_from(self.start_position):
                if (i // b) % self.world != self.rank:
                    continue
                rows.append(window)
                state = block
                if len(rows) == b:
                    batch = torch.from_numpy(np.stack(rows).astype(np.int64))
                    rows = []
                    if not self._put(out, (batch, state), stop):
                        return
        except BaseException as exc:  # handed to the training thread, raised there
            self._put(out, exc, stop)
            return
        self._put(out, KVConvertError("the data stream ended"), stop)

    @staticmethod
    def _put(out: queue.Queue, item, stop: threading.Event) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


def first_windows(stream: WindowStream, count: int) -> torch.Tensor:
    """[count, window] int64: the stream's first windows, read in this thread (DataExhausted if fewer)."""
    rows = []
    for _, window, _ in stream.windows_from():
        rows.append(window)
        if len(rows) == count:
            break
    return torch.from_numpy(np.stack(rows).astype(np.int64))
