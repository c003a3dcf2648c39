"""Per-sample result cache: REPORT_DIR/cache/<fingerprint>__<task>.jsonl.

One JSON line per finished sample: {"id", "hash", "result"}. The key is (model fingerprint,
task, sample id); `hash` is the sample's content hash, so a changed prompt or budget is
recomputed instead of reused. Lines are appended and flushed as samples finish, so an
interrupted run resumes where it stopped; a torn last line (killed mid-write) is ignored.
A folder that cannot be written is refused when the cache is made, a full disk at the sample that
does not fit: both as one line saying what to do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from kvconvert.checkpoint import atomic_save_tensors
from kvconvert.errors import KVConvertError
from kvconvert.kvmath import format_bytes


class ResultCache:
    """resume=False never answers from the cache (every sample is recomputed, even one that an
    identical model computed earlier in the same run); results are still written, newest wins."""

    def __init__(self, folder: Path, resume: bool = True,
                 fix: str = "free disk space or choose another --out (the cache is OUT/cache)"):
        self.folder = Path(folder)
        self.resume = resume
        self.fix = fix  # what to do when it cannot be written
        self._tables: dict[tuple[str, str], dict[str, dict]] = {}
        self.hits = 0
        self.misses = 0
        from kvconvert.checkpoint import check_writable

        check_writable(self.folder)  # a read-only or foreign folder: refused now, not at the first sample
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, fingerprint: str, task: str) -> Path:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", task)
        return self.folder / f"{fingerprint}__{slug}.jsonl"

    def _table(self, fingerprint: str, task: str) -> dict[str, dict]:
        key = (fingerprint, task)
        if key not in self._tables:
            table: dict[str, dict] = {}
            path = self._path(fingerprint, task)
            if self.resume and path.is_file():
                for line in path.read_text(encoding="utf-8").splitlines():
                    try:
                        entry = json.loads(line)
                        table[entry["id"]] = entry
                    except (json.JSONDecodeError, KeyError, TypeError):
                        continue  # a torn line from an interrupted write
            self._tables[key] = table
        return self._tables[key]

    def get(self, fingerprint: str, task: str, sample_id: str, content_hash: str) -> dict | None:
        entry = self._table(fingerprint, task).get(sample_id) if self.resume else None
        if entry is not None and entry.get("hash") == content_hash:
            self.hits += 1
            return entry["result"]
        self.misses += 1
        return None

    def put(self, fingerprint: str, task: str, sample_id: str, content_hash: str, result: dict) -> None:
        """Append the sample's line; a write that fails (full disk) is cut off again, so the file never
        keeps part of an entry, and reported with the bytes it needed."""
        entry = {"id": sample_id, "hash": content_hash, "result": result}
        self._table(fingerprint, task)[sample_id] = entry
        path = self._path(fingerprint, task)
        prefix = "\n" if _ends_mid_line(path) else ""  # never glue a new line onto a torn one
        line = (prefix + json.dumps(entry) + "\n").encode("utf-8")
        try:
            _append(path, line)
        except OSError as exc:
            raise KVConvertError(f"{path}: cannot write the result cache ({exc.strerror or exc}); {self.fix}, then "
                                 "rerun with the same --out: finished samples are reused (this one needed "
                                 f"{format_bytes(len(line))}{_free(path.parent)}; nothing of it was kept)") from None


def _append(path: Path, data: bytes) -> None:
    """Append `data` whole or not at all: a write cut short (full disk) is truncated away again."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def _free(folder: Path) -> str:
    try:
        return f", {format_bytes(shutil.disk_usage(folder).free)} free"
    except OSError:
        return ""


def _ends_mid_line(path: Path) -> bool:
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


# ------------------------------------------------------------------ the source's results kept across runs

SHARED_LOGITS_BYTES = 1 << 30  # source logits kept across runs, at most; least recently used dropped first


def source_results_dir() -> Path:
    """KVCONVERT_HOME/validate (default ~/.cache/kvconvert/validate): the source model's results kept
    across runs, so that each candidate (and `kvconvert plan`) does not measure the source again."""
    from kvconvert.resources import kvconvert_home

    return kvconvert_home() / "validate"


def _logits_file(folder: Path, content: str) -> Path:
    return Path(folder) / f"{content}.safetensors"


class SourceLogits:
    """The source's fp32 logits of essay windows, one safetensors file per window named by the window's
    content hash, on disk until the candidate has been compared with them: the two models never need
    to be resident together. keep=False: a scratch `folder`, removed on close. keep=True: a folder of the
    shared results (source_logits_store), kept across runs and trimmed to SHARED_LOGITS_BYTES on close."""

    def __init__(self, folder: Path, keep: bool = False):
        self.folder, self.keep = Path(folder), keep
        self.reused = 0  # windows whose logits an earlier run stored
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, content: str) -> Path:
        return _logits_file(self.folder, content)

    def has(self, content: str) -> bool:
        return self._path(content).is_file()

    def put(self, content: str, logits: torch.Tensor) -> None:
        atomic_save_tensors({"logits": logits.float().contiguous()}, self._path(content))

    def get(self, content: str) -> torch.Tensor:
        from safetensors.torch import load_file

        path = self._path(content)
        if self.keep:
            os.utime(path)  # recently used: trimmed last
        return load_file(str(path))["logits"]

    def close(self) -> None:
        import shutil

        if not self.keep:
            shutil.rmtree(self.folder, ignore_errors=True)
            return
        files = sorted(self.folder.parent.glob("*/*.safetensors"), key=lambda f: f.stat().st_mtime, reverse=True)
        total = 0
        for f in files:  # newest first: keep while the total fits
            total += f.stat().st_size
            if total > SHARED_LOGITS_BYTES:
                f.unlink(missing_ok=True)


def source_logits_store(source, windows: list, shared: Path | None, scratch: Path, say=lambda msg: None) -> SourceLogits:
    """Where the source's window logits go: the shared folder of this source runner (shared/logits/
    <fingerprint>) when there is one, the windows' logits fit SHARED_LOGITS_BYTES (4 x 512 tokens of
    SmolLM2: 0.4 GB) and its disk has room for those not stored yet (else `say` tells why not), else
    the scratch folder (removed on close), whose disk must have room for all of them: refused before
    any model runs otherwise. `source`: a RunnerInfo."""
    from kvconvert.checkpoint import ensure_free_space, free_space_problem

    def needed(folder: Path | None) -> int:  # fp32 logits + the safetensors header, a page each
        return sum(w.rows * source.vocab_size * 4 + 8192 for w in windows
                   if folder is None or not _logits_file(folder, w.key).is_file())

    if shared is not None and sum(w.rows for w in windows) * source.vocab_size * 4 <= SHARED_LOGITS_BYTES:
        folder = Path(shared) / "logits" / source.fingerprint
        problem = free_space_problem(folder, needed(folder))
        if problem is None:
            try:
                return SourceLogits(folder, keep=True)
            except OSError:  # a read-only KVCONVERT_HOME: this run keeps them to itself
                pass
        else:
            say(f"{problem} for the source's logits: this run keeps them in {scratch} (free space there to keep "
                "them across runs)")
    ensure_free_space(scratch, needed(None), fix="free some space or choose another --out (the source's logits "
                                                 "are kept there while the candidate runs)")
    return SourceLogits(scratch)


class SourceResults:
    """The result cache of the source's generation samples: the report's own (OUT/cache), backed by the
    shared one (source_results_dir()/cache) when there is one. A result found only in the shared cache
    is copied into the report's (which stays complete and resumable) and counted there as a hit; every
    new result goes to both."""

    def __init__(self, local: ResultCache, shared: ResultCache | None):
        self.local, self.shared = local, shared
        self.reused = 0  # results read from the shared cache

    def get(self, fingerprint: str, task: str, sample_id: str, content_hash: str) -> dict | None:
        result = self.local.get(fingerprint, task, sample_id, content_hash)
        if result is None and self.shared is not None:
            result = self.shared.get(fingerprint, task, sample_id, content_hash)
            if result is not None:
                self.local.put(fingerprint, task, sample_id, content_hash, result)
                self.local.misses, self.local.hits, self.reused = self.local.misses - 1, self.local.hits + 1, \
                    self.reused + 1
        return result

    def put(self, fingerprint: str, task: str, sample_id: str, content_hash: str, result: dict) -> None:
        self.local.put(fingerprint, task, sample_id, content_hash, result)
        if self.shared is not None:
            self.shared.put(fingerprint, task, sample_id, content_hash, result)
