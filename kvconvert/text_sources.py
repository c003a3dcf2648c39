"""Where training and calibration text comes from, read as documents in bounded memory (torch-free).

A text source is one of:
  builtin / pydoc, wiki, essays   the bundled corpora (kvconvert.data), one document each
  a local file                    .jsonl (one JSON object per line, its text in `text`, `content`, ...),
                                  .parquet (the `text` column, else the first), .txt (one document),
                                  and their .gz forms (.jsonl.gz, .txt.gz)
  a local folder                  every such file under it, in sorted path order (shards)
  ORG/NAME[:CONFIG]               a `datasets` id, streamed (split train); `hf:PATH` streams a local
                                  folder or file through datasets' own json/parquet/text builders
A mix names several with weights: `{A: 0.7, B: 0.3}` in a recipe, `0.7*A+0.3*B` as a flag, and
`A+B` for equal shares (parse_mix). kvconvert.data joins a source's documents into one text
(calibration); kvconvert.token_stream packs them into token windows for healing.

Every reader yields Doc(text, cursor, ends): `cursor` (a small JSON-able dict) is the position just
after this piece, so a reader restarted at it yields what followed; `ends` is False for the pieces
of a .txt longer than PIECE_BYTES, which belong to one document. A broken file is a KVConvertError
naming the file and line and what to do, raised when that line is reached.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvconvert.errors import KVConvertError

BUNDLED = ("builtin", "pydoc", "wiki", "essays")  # kvconvert.data.bundled_text reads them
FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".txt", ".txt.gz")
ROW_FIELDS = ("text", "content", "context", "input", "prompt")  # the first a row has is its text
PIECE_BYTES = 1 << 20  # a .txt is read (and tokenized) in pieces of about this many bytes, cut at a line end
PARQUET_BATCH = 1024  # rows per pyarrow batch
DATASETS_EXTRA = "pip install 'kvconvert[datasets]'"  # datasets, and pyarrow with it
SOURCE_KINDS = "builtin, wiki, a .jsonl/.parquet/.txt file or a folder of them, or a datasets id (ORG/NAME)"


@dataclass(frozen=True)
class Doc:
    text: str
    cursor: dict
    ends: bool = True  # the last piece of its document


@dataclass(frozen=True)
class TextSource:
    """One resolved source. kind: "text" (in memory: `text`), "files" (`files` under `name`) or "hub"
    (`datasets` streaming of `name`, its `config`; `builder` set for a local path read by datasets)."""

    name: str
    kind: str
    text: str | None = field(default=None, repr=False)
    files: tuple[Path, ...] = ()
    config: str | None = None
    builder: str | None = None

    def describe(self) -> dict:
        """What identifies the data (a resumed heal checks it): names and sizes, never the text."""
        if self.kind == "text":
            return {"source": self.name, "chars": len(self.text)}
        if self.kind == "files":
            return {"source": self.name, "files": len(self.files),
                    "bytes": sum(p.stat().st_size for p in self.files),
                    "names": [str(p) for p in self.files[:3]]}
        return {"source": self.name, "datasets": True, "config": self.config, "builder": self.builder}

    def total_bytes(self) -> int | None:
        return sum(p.stat().st_size for p in self.files) if self.kind == "files" else None


# --------------------------------------------------------------------------- mixes

def parse_mix(data: str | dict) -> dict[str, float]:
    """{source: weight}, the weights summing to 1, of a `data` value: one source, `A+B` (equal shares),
    `0.7*A+0.3*B`, or a mapping {A: 0.7, B: 0.3}. A name that is an existing file is never split."""
    if isinstance(data, dict):
        items = [(str(k).strip(), v) for k, v in data.items()]
    elif "+" not in data or Path(data).expanduser().exists():
        items = [(data, 1.0)]
    else:
        items = [_weighted(part.strip(), data) for part in data.split("+")]
    if not items or not all(name for name, _ in items):
        raise ValueError(f"{data!r}: a mix names its texts joined by '+' (pydoc+wiki) or with weights "
                         "(0.7*A+0.3*B, or {A: 0.7, B: 0.3} in a recipe)")
    for name, weight in items:
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 < weight < math.inf:
            raise ValueError(f"{data!r}: the weight of {name!r} must be a positive number (finite), got {weight!r}")
    if len({name for name, _ in items}) < len(items):
        raise ValueError(f"{data!r}: a text is named twice in the mix")
    total = sum(w for _, w in items)
    if not math.isfinite(total):  # each finite, their sum not (1e308*A+1e308*B): every share would read as 0
        raise ValueError(f"{data!r}: the weights sum beyond a float's range; give them as shares such as 0.5*A+0.5*B")
    return {name: w / total for name, w in items}


def _weighted(part: str, whole: str) -> tuple[str, float]:
    """`0.7*A` -> (A, 0.7); `A` -> (A, 1.0)."""
    head, star, tail = part.partition("*")
    if not star:
        return part, 1.0
    try:
        return tail.strip(), float(head)
    except ValueError:
        raise ValueError(f"{whole!r}: {part!r} is not WEIGHT*TEXT (e.g. 0.7*{tail.strip() or 'A'})") from None


def mix_text(data: str | dict) -> str:
    """The flag form of a `data` value (a mapping becomes 0.7*A+0.3*B)."""
    if isinstance(data, str):
        return data
    return "+".join(f"{weight:g}*{name}" for name, weight in data.items())


# --------------------------------------------------------------------------- resolving a name

def text_source(name: str, bundled=None) -> TextSource:
    """The source `name` names (see the module docstring). bundled(name) -> str reads the bundled
    corpora (kvconvert.data passes its reader; this module stays torch-free)."""
    if name in BUNDLED:
        if bundled is None:
            raise KVConvertError(f"{name}: a bundled corpus, read through kvconvert.data")
        return TextSource(name, "text", text=bundled(name))
    if name.startswith("hf:"):
        return _hub_source(name[3:], name)
    path = Path(name).expanduser()
    if path.is_file():
        _check_suffix(path)
        return TextSource(name, "files", files=(path,))
    if path.is_dir():
        files = tuple(sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p) in FILE_SUFFIXES))
        if not files:
            raise KVConvertError(f"{path}: a folder with no {', '.join(FILE_SUFFIXES)} files in it; put the "
                                 "training text there, or name a file")
        return TextSource(name, "files", files=files)
    if _looks_like_path(name):
        raise KVConvertError(f"{name}: no such file or folder; give an existing path (text sources: {SOURCE_KINDS})")
    return _hub_source(name, name)


def _suffix(path: Path) -> str:
    return "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix


def _check_suffix(path: Path) -> None:
    if _suffix(path) not in FILE_SUFFIXES:
        raise KVConvertError(f"{path}: unsupported data file type {_suffix(path)!r} (use {', '.join(FILE_SUFFIXES)})")


def _looks_like_path(name: str) -> bool:
    """A name no datasets id can be: a file suffix, a path prefix, or more than ORG/NAME."""
    if "/" not in name:
        return True
    base = name.split(":", 1)[0]
    return (any(base.endswith(s) for s in (*FILE_SUFFIXES, ".json", ".csv", ".gz")) or base.startswith((".", "/", "~"))
            or base.count("/") != 1)


def _hub_source(spec: str, name: str) -> TextSource:
    path = Path(spec).expanduser()
    if path.exists():  # a local folder or file through datasets' packaged builders
        builder = None if path.is_dir() else {".jsonl": "json", ".json": "json", ".parquet": "parquet",
                                               ".txt": "text"}.get(path.suffix)
        if path.is_file() and builder is None:
            raise KVConvertError(f"{name}: datasets reads .jsonl, .json, .parquet or .txt files, not {path.suffix!r}")
        return TextSource(name, "hub", builder=builder or "folder")
    return TextSource(name, "hub", config=spec.partition(":")[2] or None)


# --------------------------------------------------------------------------- reading documents

def joined_text(source: TextSource, max_chars: int | None = None) -> str:
    """The source's documents joined by blank lines (a document's pieces joined as read), stopping
    once `max_chars` characters are read."""
    parts, size, open_doc = [], 0, False
    for doc in documents(source):
        if parts and not open_doc:
            parts.append("\n\n")
        parts.append(doc.text)
        size += len(doc.text)
        open_doc = not doc.ends
        if max_chars is not None and size >= max_chars:
            break
    return "".join(parts)


def documents(source: TextSource, cursor: dict | None = None) -> Iterator[Doc]:
    """The source's documents from `cursor` (None: the start) to its end."""
    if source.kind == "text":
        if not cursor:
            yield Doc(source.text, {"done": 1})
        return
    if source.kind == "hub":
        yield from _hub_documents(source, cursor)
        return
    start = cursor or {"file": 0}
    for i in range(start["file"], len(source.files)):
        at = start if i == start["file"] else {}
        path = source.files[i]
        kind = _suffix(path)
        if kind in (".jsonl", ".jsonl.gz"):
            rows = _jsonl_documents(path, at)
        elif kind == ".parquet":
            rows = _parquet_documents(path, at)
        else:
            rows = _txt_documents(path, at)
        for text, position, ends in rows:
            yield Doc(text, {"file": i, **position}, ends)


@contextlib.contextmanager
def _open(path: Path):
    """The file, binary; a .gz file decompressed. A compressed file that ends early (truncated: gzip's EOFError,
    which would otherwise read as Ctrl-C) or holds damaged data is named as such."""
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
            yield f
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise KVConvertError(f"{path}: the compressed file is truncated or damaged ({type(exc).__name__}: {exc}); "
                             "write or download it again, or leave it out of the data") from None


def _jsonl_documents(path: Path, at: dict) -> Iterator[tuple[str, dict, bool]]:
    """(text, position after it, True) per non-blank line. Position: the line number and, for a plain
    file, the byte offset (seeked to on a restart; a .gz file is read through to that line)."""
    line_no, offset = at.get("line", 0), at.get("offset", 0)
    with _open(path) as f:
        if path.suffix == ".gz":
            for _ in range(line_no):
                f.readline()
        else:
            f.seek(offset)
        for raw in f:
            line_no += 1
            offset += len(raw)
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise KVConvertError(
                    f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); convert the "
                    f"file to UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                what = exc.msg.removesuffix(" at")  # json's "Unterminated string starting at" names a position
                raise KVConvertError(f"{where}: not valid JSON ({what} at column {exc.colno}); each line must be "
                                     "one JSON object like {\"text\": \"...\"}: fix or delete that line") from None
            yield row_text(row, where), {"line": line_no, "offset": offset}, True


def row_text(row, where: str) -> str:
    """The text of one row (a JSON object or a datasets row): its first ROW_FIELDS field."""
    if not isinstance(row, dict):
        plain = isinstance(row, (int, float, str, list, bool, type(None)))
        shown = json.dumps(row)[:40] if plain else type(row).__name__
        raise KVConvertError(f"{where}: a row is {shown} ({type(row).__name__}), not a JSON object; each line must be "
                             "an object with the text in a 'text' field, e.g. {\"text\": \"...\"}")
    for key in ROW_FIELDS:
        if key in row:
            value = row[key]
            if not isinstance(value, str):
                raise KVConvertError(f"{where}: field {key!r} is {type(value).__name__}, not a string; put the text "
                                     f"itself in {key!r}")
            return value
    raise KVConvertError(f"{where}: a row has no 'text' field (nor {', '.join(ROW_FIELDS[1:])}; its keys: "
                         f"{sorted(row)[:5]}); put each row's text in 'text'")


def _pyarrow_parquet(path):
    try:
        import pyarrow.parquet as pq
    except ImportError:  # ModuleNotFoundError, or a broken install
        raise KVConvertError(f"{path}: reading .parquet needs pyarrow, which is not installed: {DATASETS_EXTRA} "
                             "(or pip install pyarrow), or convert the file to .jsonl") from None
    return pq


def _parquet_documents(path: Path, at: dict) -> Iterator[tuple[str, dict, bool]]:
    """(text, position after it, True) per row of the `text` column (else the first), batch by batch."""
    pq = _pyarrow_parquet(path)
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's ArrowInvalid / OSError on a damaged or non-parquet file
        raise KVConvertError(f"{path}: not a readable parquet file ({type(exc).__name__}: {str(exc)[:120]})") from None
    names = pf.schema_arrow.names
    column = "text" if "text" in names else names[0]
    row = at.get("row", 0)
    groups, first = [], 0  # row groups from the one holding `row`
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if first + n > row:
            groups.append(g)
        elif not groups:
            first += n
    index = first
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=groups, columns=[column]) if groups else ():
        for value in batch.column(0).to_pylist():
            index += 1
            if index <= row:
                continue
            if not isinstance(value, str):
                raise KVConvertError(f"{path}: row {index} of column {column!r} is {type(value).__name__}, not text; "
                                     "name the text column 'text'")
            yield value, {"row": index}, True


MOST_UNDECODABLE = 0.01  # invalid UTF-8 sequences per byte a .txt piece may hold (with a warning) before it is refused
_WARNED: set[Path] = set()  # files whose replaced bytes were reported (once per file and process)


def utf8_piece(raw: bytes, path: Path, start: int) -> str:
    """A piece of a .txt data file (bytes `start`..) as text. Invalid UTF-8 reads as U+FFFD with a warning (once
    per file) naming the file and how much; a piece that is more than MOST_UNDECODABLE invalid (a binary file,
    another encoding) is refused: healing or calibrating on replacement characters is silently wrong data."""
    text = raw.decode("utf-8", errors="replace")
    replaced = text.count("\ufffd") - raw.count("\ufffd".encode())  # U+FFFD the file itself holds are no error
    if not replaced:
        return text
    what = f"{replaced} invalid UTF-8 sequences in its bytes {start}-{start + len(raw)} ({replaced / len(raw):.2%})"
    if replaced > MOST_UNDECODABLE * len(raw):
        raise KVConvertError(f"{path}: {what}: not UTF-8 text (a binary file, or another encoding); convert it to "
                             f"UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}")
    if path not in _WARNED:
        _WARNED.add(path)
        print(f"warning: {path}: {what}, read as U+FFFD", file=sys.stderr)
    return text


def _txt_documents(path: Path, at: dict) -> Iterator[tuple[str, dict, bool]]:
    """The file as one document, in pieces of about PIECE_BYTES cut at line ends (a line longer than
    that at a UTF-8 character boundary). Position: the byte offset (of the decompressed text)."""
    offset = at.get("offset", 0)
    with _open(path) as f:
        f.seek(offset)
        piece = _next_piece(f)
        if not piece and not offset:
            yield "", {"offset": 0}, True  # an empty file: an empty document
        while piece:
            offset += len(piece)
            following = _next_piece(f)
            yield utf8_piece(piece, path, offset - len(piece)), {"offset": offset}, not following
            piece = following


def _next_piece(f) -> bytes:
    """About PIECE_BYTES from f, to the end of a line (or of a UTF-8 character in a longer line)."""
    piece = f.read(PIECE_BYTES)
    if not piece or piece.endswith(b"\n"):
        return piece
    piece += f.readline(PIECE_BYTES)
    if piece.endswith(b"\n") or len(piece) < 2 * PIECE_BYTES:  # a line's end, or the file's
        return piece
    cut = len(piece)
    while cut > 1 and (piece[cut - 1] & 0xC0) == 0x80:  # back over continuation bytes
        cut -= 1
    cut -= piece[cut - 1] >= 0xC0  # and the character's lead byte
    f.seek(f.tell() - (len(piece) - cut))
    return piece[:cut]


def _hub_documents(source: TextSource, cursor: dict | None) -> Iterator[Doc]:
    """Rows of a `datasets` streaming dataset (split train); the cursor is its state_dict."""
    try:
        import datasets
    except ImportError:
        raise KVConvertError(f"{source.name}: streaming a datasets id needs the datasets package: {DATASETS_EXTRA} "
                             f"(or give a local file or folder: {SOURCE_KINDS})") from None
    spec = source.name[3:] if source.name.startswith("hf:") else source.name
    try:
        if source.builder == "folder":
            ds = datasets.load_dataset(str(Path(spec).expanduser()), split="train", streaming=True)
        elif source.builder:
            ds = datasets.load_dataset(source.builder, data_files=str(Path(spec).expanduser()), split="train",
                                       streaming=True)
        else:
            ds = datasets.load_dataset(spec.partition(":")[0], source.config, split="train", streaming=True)
        if cursor:
            ds.load_state_dict(cursor["state"])
    except Exception as exc:
        raise KVConvertError(f"{source.name}: cannot stream this datasets id ({type(exc).__name__}: {str(exc)[:160]}); "
                             "no network? download it and give the local folder") from None
    n = cursor["row"] if cursor else 0
    rows = iter(ds)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as exc:
            raise KVConvertError(f"{source.name} row {n + 1}: cannot read it ({type(exc).__name__}: "
                                 f"{str(exc)[:160]})") from None
        n += 1
        yield Doc(row_text(row, f"{source.name} row {n}"), {"row": n, "state": ds.state_dict()})
