"""Weight identity of a checkpoint folder: the fingerprint that keys cached results and artifact
provenance (kvconvert.checkpoint.provenance, validate's result cache, heal's resumable state).

    checkpoint_fingerprint(folder)  16 hex chars: sha256 of {file name: sha256 of its bytes}

The files are config.json, every *.safetensors and everything manifest.json lists (tokenizer,
index, calibration report...). Each file's sha256 comes from the cheapest source that still
follows its content:

1. manifest.json (CheckpointWriter) when its entry records the file's current size *and*
   mtime_ns: the writer hashed those bytes and nothing has written the file since;
2. the hash cache KVCONVERT_HOME/hashes, keyed on (real path, size, mtime_ns, inode): a file
   hashed once is not read again until it changes;
3. otherwise the file is read once and hashed (and the result cached).

So an in-place edit (same size, new mtime) changes the fingerprint; a byte-identical copy keeps
it (its hashes are equal, whatever its mtimes); a manifest that no longer describes the folder is
not trusted. What it does not detect: a file whose bytes were changed and whose size and mtime_ns
were then restored by hand (touch -d), or an edit on a filesystem whose mtime is coarser than
the time between the write and the edit. Cost: a stat per file when nothing changed; one read of a
changed or never-seen file (about the time the NaN scan takes to read it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from kvconvert.checkpoint.reader import read_manifest
from kvconvert.errors import CheckpointError
from kvconvert.resources import kvconvert_home


def _cache_dir() -> Path:
    return kvconvert_home() / "hashes"


def _stat_key(path: Path, stat: os.stat_result) -> str:
    raw = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    return hashlib.sha256(raw.encode()).hexdigest()


def _cached_sha256(path: Path, stat: os.stat_result) -> str:
    """sha256 of the file, from the hash cache when (path, size, mtime_ns, inode) were seen before."""
    entry = _cache_dir() / _stat_key(path, stat)
    try:
        digest = entry.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}")
    try:  # a cache that cannot be written (full disk) costs a re-read next time, nothing else
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(digest)
        os.replace(tmp, entry)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # no partial entry left behind
    return digest


def file_sha256(path: Path, recorded: dict | None = None) -> str | None:
    """sha256 of `path` (None when it does not exist), trusting `recorded` (its manifest.json entry)
    only when the entry's size and mtime_ns are the file's current ones."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    if isinstance(recorded, dict) and recorded.get("sha256") and recorded.get("bytes") == stat.st_size \
            and recorded.get("mtime_ns") == stat.st_mtime_ns:
        return recorded["sha256"]
    return _cached_sha256(path, stat)


def checkpoint_fingerprint(folder: str | Path) -> str:
    """Content hash of a checkpoint folder, 16 hex chars (see the module docstring)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: config.json not found; expected a Hugging Face model folder")
    files = read_manifest(folder).get("files")
    files = files if isinstance(files, dict) else {}
    names = set(files) | {"config.json"} | {p.name for p in folder.glob("*.safetensors")}
    table = {name: file_sha256(folder / name, files.get(name)) for name in sorted(names)}
    # the same serialization as the manifest-only fingerprint before mtimes were recorded, so results
    # cached for an unchanged kvconvert output keep their key
    return hashlib.sha256(json.dumps(table).encode()).hexdigest()[:16]
