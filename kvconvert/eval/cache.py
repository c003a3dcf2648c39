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
import re
from pathlib import Path

from kvconvert.errors import KVConvertError


class ResultCache:
    """resume=False never answers from the cache (every sample is recomputed, even one that an
    identical model computed earlier in the same run); results are still written, newest wins."""

    def __init__(self, folder: Path, resume: bool = True):
        self.folder = Path(folder)
        self.resume = resume
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
        entry = {"id": sample_id, "hash": content_hash, "result": result}
        self._table(fingerprint, task)[sample_id] = entry
        path = self._path(fingerprint, task)
        prefix = "\n" if _ends_mid_line(path) else ""  # never glue a new line onto a torn one
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(prefix + json.dumps(entry) + "\n")
                f.flush()
        except OSError as exc:
            raise KVConvertError(f"{path}: cannot write the result cache ({exc.strerror or exc}); free disk space or "
                                 "choose another --out (the cache is OUT/cache), then rerun with the same --out: "
                                 "finished samples are reused") from None


def _ends_mid_line(path: Path) -> bool:
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"
