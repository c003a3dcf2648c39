"""Fixtures for this folder's tests; the builders they use live in heal_cases.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))  # eval_fixtures, for heal_cases
from heal_cases import build_llama, convert_tiny  # noqa: E402


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """~40K tokens of the built-in corpus as a local .txt (tokenizing all of it is slow)."""
    from kvconvert.data import pydoc_corpus

    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(pydoc_corpus()[200_000:300_000])
    return path


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> Path:
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead on a shared CPU
    return build_llama(tmp_path_factory.mktemp("teacher") / "llama")


@pytest.fixture(scope="session")
def tiny_student(tiny_teacher, text_file, tmp_path_factory) -> Path:
    """rank 8 + rope 8 (of 2 kv heads x 16 dims): a lossy conversion that healing can improve."""
    return convert_tiny(tiny_teacher, tmp_path_factory.mktemp("student") / "mla", text_file)


@pytest.fixture(scope="session")
def shard_folder(tmp_path_factory) -> Path:
    """The same ~100 KB of the built-in corpus as text_file, as a folder of streamed shards: its paragraphs
    as documents over three .jsonl files and a .parquet (kvconvert.text_sources reads them in path order)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvconvert.data import pydoc_corpus

    paragraphs = [p for p in pydoc_corpus()[200_000:300_000].split("\n\n") if p.strip()]
    folder = tmp_path_factory.mktemp("shards")
    quarter = len(paragraphs) // 4
    for i in range(3):
        rows = paragraphs[i * quarter:(i + 1) * quarter]
        (folder / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in rows))
    pq.write_table(pa.table({"text": paragraphs[3 * quarter:]}), folder / "part-3.parquet", row_group_size=64)
    return folder
