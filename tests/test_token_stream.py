"""Streamed training text (kvconvert.text_sources, kvconvert.token_stream): shard folders of every file
type, datasets streaming of local files, weighted mixes, windows packed on the fly, every window once
per epoch, disjoint and world-size-independent process shares, exact resumption from a saved position,
tokenization on a background thread, and peak memory that does not grow with the corpus."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.text_sources import documents, joined_text, parse_mix, text_source
from kvconvert.token_stream import (
    Batches, DataExhausted, Packer, WindowStream, first_windows, separator_ids,
)

EOS = "<eos>"


def make_tokenizer():
    """One id per whitespace-separated word w0..w999, and an EOS token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, EOS: 1, **{f"w{i}": i + 2 for i in range(1000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token=EOS)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def doc(i: int, words: int = 37) -> str:
    """Document i: its number in base 1000 as the first two words, then a run of words."""
    return " ".join([f"w{i // 1000}", f"w{i % 1000}"] + [f"w{(i * 7 + k) % 1000}" for k in range(words - 2)])


def write_shards(folder: Path, docs: int, per_shard: int = 50) -> Path:
    """`docs` documents over .jsonl, .jsonl.gz and .parquet shards (in sorted order: doc 0 first)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for s, start in enumerate(range(0, docs, per_shard)):
        texts = [doc(i) for i in range(start, min(docs, start + per_shard))]
        kind = s % 3
        name = folder / f"shard-{s:04d}"
        if kind == 0:
            name.with_suffix(".jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        elif kind == 1:
            with gzip.open(name.with_suffix(".jsonl.gz"), "wt") as f:
                f.writelines(json.dumps({"content": t}) + "\n" for t in texts)
        else:
            pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), name.with_suffix(".parquet"),
                           row_group_size=16)
    return folder


# --------------------------------------------------------------------------- reading documents

def test_a_folder_of_shards_reads_every_document_in_order_and_resumes_at_any_cursor(tmp_path):
    folder = write_shards(tmp_path / "shards", 180)
    (folder / "README.md").write_text("not data")  # other files are not shards
    source = text_source(str(folder))
    assert len(source.files) == 4
    docs = list(documents(source))
    assert [d.text for d in docs] == [doc(i) for i in range(180)]
    for k in (0, 1, 49, 50, 75, 99, 100, 116, 179):  # restarted after document k: the rest, exactly
        assert [d.text for d in documents(source, docs[k].cursor)] == [doc(i) for i in range(k + 1, 180)]


def test_a_txt_is_one_document_read_in_pieces_that_resume(tmp_path, monkeypatch):
    import kvconvert.text_sources as ts

    monkeypatch.setattr(ts, "PIECE_BYTES", 64)
    # lines with 2-byte characters, then a last line longer than a piece
    text = "".join(f"line {i} caf\u00e9 na\u00efve\n" for i in range(40)) + "x" * 150 + "\u00e9" * 30
    path = tmp_path / "a.txt"
    path.write_text(text, encoding="utf-8")
    pieces = list(documents(text_source(str(path))))
    assert len(pieces) > 5 and "".join(p.text for p in pieces) == text
    assert [p.ends for p in pieces] == [False] * (len(pieces) - 1) + [True]
    for k in range(len(pieces)):
        rest = "".join(p.text for p in documents(text_source(str(path)), pieces[k].cursor))
        assert "".join(p.text for p in pieces[: k + 1]) + rest == text


def test_datasets_streaming_of_local_files_reads_the_same_documents_and_resumes(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    for s in range(2):
        (folder / f"part-{s}.jsonl").write_text("".join(json.dumps({"text": doc(i)}) + "\n"
                                                        for i in range(s * 30, s * 30 + 30)))
    streamed = list(documents(text_source(f"hf:{folder}")))  # datasets' json builder, streaming
    assert [d.text for d in streamed] == [doc(i) for i in range(60)]
    rest = list(documents(text_source(f"hf:{folder}"), streamed[40].cursor))
    assert [d.text for d in rest] == [doc(i) for i in range(41, 60)]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [doc(i) for i in range(20)]}), tmp_path / "p.parquet")
    assert [d.text for d in documents(text_source(f"hf:{tmp_path / 'p.parquet'}"))] == [doc(i) for i in range(20)]


def test_mix_specs():
    assert parse_mix("builtin") == {"builtin": 1.0}
    assert parse_mix("pydoc+wiki") == {"pydoc": 0.5, "wiki": 0.5}
    assert parse_mix("0.7*a/b+0.3*c") == {"a/b": 0.7, "c": pytest.approx(0.3)}
    assert parse_mix({"fineweb": 7, "code": 3}) == {"fineweb": 0.7, "code": 0.3}
    for bad in ("a+", "x*a+b", {"a": 0}, {"a": -1.0}, "a+a"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_joined_text_stops_near_max_chars(tmp_path):
    folder = write_shards(tmp_path / "shards", 120)
    text = joined_text(text_source(str(folder)), max_chars=len(doc(0)) * 3)
    assert text == "\n\n".join(doc(i) for i in range(3))


# --------------------------------------------------------------------------- packing, mixing, shuffling

def all_windows(stream: WindowStream, count: int) -> np.ndarray:
    return first_windows(stream, count).numpy()


def test_windows_are_the_documents_tokens_with_eos_between(tmp_path, tok):
    folder = write_shards(tmp_path / "shards", 60)
    stream = WindowStream([(text_source(str(folder)), 1.0)], tok, 50, shuffle=False)
    ids = tok([doc(i) for i in range(60)], add_special_tokens=False)["input_ids"]
    flat = np.concatenate([np.asarray(r + separator_ids(tok)) for r in ids])
    n = flat.size // 50
    assert np.array_equal(all_windows(stream, n), flat[: n * 50].reshape(n, 50))
    with pytest.raises(DataExhausted, match=f"holds {n} whole 50-token windows"):
        all_windows(stream, n + 1)  # max_epochs 1


def test_a_weighted_mix_interleaves_exact_shares(tmp_path, tok):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": doc(i)}) + "\n" for i in range(100)))
    b.write_text("".join(json.dumps({"text": doc(5000 + i)}) + "\n" for i in range(100)))
    stream = WindowStream([(text_source(str(a)), 0.75), (text_source(str(b)), 0.25)], tok, 38, shuffle=False)
    windows = all_windows(stream, 40)
    from_b = [int(w[0]) == 2 + 5 for w in windows]  # doc(5000 + i) starts with w5
    assert sum(from_b) == 10 and from_b[:8] == [False, False, True, False, False, False, True, False]


def test_every_window_once_per_epoch_in_seeded_blocks(tmp_path, tok):
    folder = write_shards(tmp_path / "shards", 300)
    plain = WindowStream([(text_source(str(folder)), 1.0)], tok, 32, shuffle=False)
    n = 300 * 38 // 32
    ordered = all_windows(plain, n)
    for block in (64, 4096):  # several blocks per epoch, and one block holding the whole epoch
        shuffled = WindowStream([(text_source(str(folder)), 1.0)], tok, 32, seed=3, max_epochs=2, block=block)
        two_epochs = all_windows(shuffled, 2 * n)
        for epoch in (two_epochs[:n], two_epochs[n:]):
            assert Counter(map(bytes, epoch)) == Counter(map(bytes, ordered))
        assert not np.array_equal(two_epochs[:n], ordered)
        again = WindowStream([(text_source(str(folder)), 1.0)], tok, 32, seed=3, max_epochs=2, block=block)
        assert np.array_equal(all_windows(again, 2 * n), two_epochs)  # deterministic


# --------------------------------------------------------------------------- processes, resumption, prefetch

def stream_of(folder: Path, tok, seed: int = 0, block: int = 50) -> WindowStream:
    return WindowStream([(text_source(str(folder)), 1.0)], tok, 24, seed=seed, max_epochs=3, block=block)


def take(batches: Batches, n: int) -> list[torch.Tensor]:
    try:
        return [batches.get() for _ in range(n)]
    finally:
        batches.close()


def test_two_ranks_take_disjoint_shares_that_make_up_the_one_process_batches(tmp_path, tok):
    folder = write_shards(tmp_path / "shards", 200)
    one = take(Batches(stream_of(folder, tok), batch_size=4), 79)  # 316 windows in an epoch: 79 x 4
    ranks = [take(Batches(stream_of(folder, tok), batch_size=2, rank=r, world=2), 79) for r in (0, 1)]
    # global micro-batch g of batch 2 goes to rank g % 2; one process with batch 4 reads g = 2k, 2k + 1 together
    for k, batch in enumerate(one):
        assert torch.equal(batch, torch.cat([ranks[0][k], ranks[1][k]]))
    seen = [Counter(bytes(w.numpy()) for b in r for w in b) for r in ranks]
    assert not (seen[0].keys() & seen[1].keys())  # no window read by both
    epoch = first_windows(WindowStream([(text_source(str(folder)), 1.0)], tok, 24, shuffle=False), 316)
    assert seen[0] + seen[1] == Counter(bytes(w.numpy()) for w in epoch)  # together: every window once


def test_a_saved_position_resumes_the_exact_batches(tmp_path, tok):
    folder = write_shards(tmp_path / "shards", 200)
    for world in (1, 2):
        for stop in (1, 7, 13, 30):  # steps of grad_accum 2; block 50 windows: several block boundaries
            full = [take(Batches(stream_of(folder, tok, seed=1), 3, r, world), 2 * 40) for r in range(world)]
            parts = [Batches(stream_of(folder, tok, seed=1), 3, r, world) for r in range(world)]
            for p in parts:
                for _ in range(stop):
                    p.get(), p.get()
                    p.mark()
            saved = parts[0].position(stop * 2 * world * 3)  # what the main process saves
            for p in parts:
                p.close()
            for r in range(world):
                resumed = Batches(stream_of(folder, tok, seed=1), 3, r, world)
                resumed.seek(json.loads(json.dumps(saved, default=lambda t: t.tolist()), object_hook=_tensors))
                got = take(resumed, 2 * 40 - 2 * stop)
                assert all(torch.equal(a, b) for a, b in zip(got, full[r][2 * stop:])), (world, stop, r)


def _tensors(obj: dict) -> dict:
    """The saved carry tokens back as tensors (the state went through JSON here, as a torch.save would keep them)."""
    if "carry" in obj and isinstance(obj["carry"], list):
        obj["carry"] = torch.tensor(obj["carry"], dtype=torch.int32)
    return obj


def test_tokenization_runs_on_a_background_thread_ahead_of_a_slow_consumer(tmp_path, tok, monkeypatch):
    folder = write_shards(tmp_path / "shards", 200)
    threads = set()
    real = Packer._read

    def spy(self):
        threads.add(threading.get_ident())
        return real(self)

    monkeypatch.setattr(Packer, "_read", spy)
    batches = Batches(stream_of(folder, tok), batch_size=2, depth=4)
    batches.get()
    first_wait = batches.wait_s
    for _ in range(10):
        time.sleep(0.05)  # a training step
        batches.get()
    assert threads and threading.get_ident() not in threads
    assert batches.wait_s - first_wait < 0.02  # the queue was always full: the step never waited
    assert batches._queue.qsize() <= 4  # bounded
    batches.close()
    assert batches._thread is None


def test_a_broken_shard_is_raised_on_the_training_thread(tmp_path, tok):
    folder = write_shards(tmp_path / "shards", 60)
    (folder / "shard-9999.jsonl").write_text('{"text": "w1 w2"}\n{"text": broken\n')
    batches = Batches(WindowStream([(text_source(str(folder)), 1.0)], tok, 24), batch_size=1)
    with pytest.raises(KVConvertError, match=r"shard-9999\.jsonl:2: not valid JSON"):
        take(batches, 1000)


PEAK_SCRIPT = r"""
import json, sys, pathlib
from transformers import AutoTokenizer
from kvconvert.text_sources import text_source
from kvconvert.token_stream import Batches, DataExhausted, WindowStream

def peak():
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

tok = AutoTokenizer.from_pretrained(sys.argv[2])
stream = WindowStream([(text_source(sys.argv[1]), 1.0)], tok, 256, seed=0, block=256)
batches = Batches(stream, batch_size=4)
for _ in range(64):  # warm: every reader, the tokenizer, the thread and a full queue
    batches.get()
before = peak()
n = 64
try:
    while True:
        batches.get()
        n += 1
except DataExhausted:
    pass
print(json.dumps({"batches": n, "warm_peak": before, "peak": peak()}))
"""


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_corpus(tmp_path, tok):
    """The same stream over a corpus and over 10x that corpus: the process's peak RSS (VmHWM, read in a
    fresh subprocess) is the same within 5 MB: 1.1M tokens (~5 MB of text) against 110K."""
    tok.save_pretrained(tmp_path / "tok")
    small = write_shards(tmp_path / "small", 3000, per_shard=500)
    large = write_shards(tmp_path / "large", 30000, per_shard=500)
    runs = {}
    for name, folder in (("small", small), ("large", large)):
        done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(folder), str(tmp_path / "tok")],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[name] = json.loads(done.stdout.splitlines()[-1])
    print(runs)
    assert runs["large"]["batches"] > 9 * runs["small"]["batches"]
    grown = runs["large"]["peak"] - runs["small"]["peak"]
    assert grown < 5 * 2**20, runs
