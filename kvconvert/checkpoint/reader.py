"""Lazy, tensor-by-tensor reading of Hugging Face checkpoint folders (safetensors only).

Nothing is unpickled: weights come from safetensors files through `safe_open`, which memory-maps
the file and reads one tensor at a time, so one decoder layer can be processed without loading
the model.
"""

from __future__ import annotations

import json
import math
import mmap
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from kvconvert.errors import CheckpointError
from kvconvert.st_header import INDEX_NAME, SINGLE_NAME, index_weight_map, read_json_object, safetensors_header

# safetensors dtype names -> torch dtypes (those a checkpoint's weights and scales use)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
              "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def read_config(folder: Path) -> dict:
    """config.json of an HF folder as a dict, with a one-line error when missing or broken (not UTF-8,
    not JSON, not a JSON object). Every command reads a model's config through here."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: config.json not found; point --src at a Hugging Face model folder")
    return read_json_object(path, "config.json")


def read_manifest(folder: Path) -> dict:
    """manifest.json of a folder that kvconvert wrote (CheckpointWriter), or {} when it has none or it is unreadable."""
    try:
        manifest = json.loads((Path(folder) / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def healed_cache_format(folder: Path) -> str | None:
    """The cache format the checkpoint in `folder` was healed through (its manifest's heal recipe,
    heal_distill.kv_dtype: kvconvert.heal.quant_aware), or None when its heal, if any, was not
    quantization-aware. Read by calibrate (kvconvert.quant.run.keep_heal_basis) and the benchmarks."""
    distill = read_manifest(folder).get("kvconvert_heal", {}).get("recipe", {}).get("heal_distill") or {}
    return distill.get("kv_dtype")


# Files that hold a tokenizer's vocabulary; a folder needs at least one (tokenizer_config.json
# alone only names a class, AutoTokenizer still fails without a vocabulary).
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_tokenizer_files(folder: Path) -> None:
    """A one-line CheckpointError when the folder has no tokenizer vocabulary file (a check on file
    names only: transformers is not imported)."""
    folder = Path(folder)
    if not any((folder / f).is_file() for f in TOKENIZER_VOCAB_FILES):
        raise CheckpointError(
            f"{folder}: no tokenizer files (none of {', '.join(TOKENIZER_VOCAB_FILES)}); copy them (and "
            "tokenizer_config.json) from the model this folder came from")


def load_tokenizer(folder: Path):
    """The folder's own tokenizer (AutoTokenizer, no remote code); clear error when absent."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    check_tokenizer_files(folder)
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:  # transformers raises many error types here
        raise CheckpointError(f"{folder}: cannot load its tokenizer ({type(exc).__name__}: {exc})") from None


def eos_token_ids(folder: Path, config: dict | None = None) -> tuple[int, ...]:
    """EOS ids named by config.json (or `config`, when already read) and generation_config.json:
    an int or a list in either; an unreadable generation_config.json names none."""
    sources = [config if config is not None else read_config(folder)]
    try:
        sources.append(json.loads((Path(folder) / "generation_config.json").read_text()))
    except (OSError, json.JSONDecodeError):
        pass
    found: list[int] = []
    for src in sources:
        eos = src.get("eos_token_id") if isinstance(src, dict) else None
        if isinstance(eos, int):
            found.append(eos)
        elif isinstance(eos, list):
            found.extend(int(e) for e in eos)
    return tuple(dict.fromkeys(found))


def _drop_pages(mm: mmap.mmap, start: int, end: int) -> None:
    """Let the kernel drop the mapped pages wholly inside [start, end) from this process's RSS
    (MADV_DONTNEED; the mapping is private and never written, so a later read re-faults the
    file's bytes). Pages shared with a neighbouring tensor stay."""
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    if hi > lo and hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class CheckpointReader:
    """Read an HF checkpoint folder lazily.

    Attributes: path (Path), config (dict). Tensors are fetched one at a time with `get`.
    """

    def __init__(self, path: str | Path, verify: bool = True):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a folder; expected a Hugging Face model folder")
        self.config = read_config(self.path)
        self.weight_map = self._weight_map()
        self._handles: dict[str, object] = {}
        self._maps: dict[str, tuple[mmap.mmap, int, dict]] = {}
        if verify:
            self._verify_files()

    def _verify_files(self) -> None:
        """Each file's header against its size (catches truncation) and, for a sharded folder, the
        index against the headers: a tensor the index puts in a shard that lacks it (a partial
        download, a stale index) is named with that shard here, before any command does work.
        Headers only: no tensor data is read."""
        listed: dict[str, list[str]] = {}
        for name, shard in self.weight_map.items():
            listed.setdefault(shard, []).append(name)
        for shard in sorted(listed):
            header = safetensors_header(self.path / shard)
            absent = [name for name in listed[shard] if name not in header]
            if absent:
                more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
                raise CheckpointError(
                    f"{self.path / shard}: tensor {absent[0]!r}{more} is listed in {INDEX_NAME} but not in this "
                    "file; the download is incomplete or the index is stale: re-download the checkpoint "
                    "(or re-export it)")

    def _weight_map(self) -> dict[str, str]:
        weight_map = index_weight_map(self.path)
        if weight_map is not None:
            return weight_map
        single = self.path / SINGLE_NAME
        if single.is_file():  # the header's names, sorted as safe_open lists them
            return dict.fromkeys(sorted(safetensors_header(single)), SINGLE_NAME)
        if list(self.path.glob("*.bin")) or list(self.path.glob("*.pt")):
            raise CheckpointError(
                f"{self.path}: only pickle weights (.bin/.pt) found; kvconvert loads safetensors only "
                "(convert with transformers: model.save_pretrained(dir, safe_serialization=True))"
            )
        if list(self.path.glob("*.gguf")):
            raise CheckpointError(f"{self.path}: GGUF found; import it first with `kvconvert import-gguf`")
        raise CheckpointError(f"{self.path}: no model.safetensors or {INDEX_NAME} found")

    def _handle(self, filename: str):
        if filename not in self._handles:
            try:
                self._handles[filename] = safe_open(self.path / filename, framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{self.path / filename}: cannot open ({exc})") from None
        return self._handles[filename]

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._read(name, lambda h: h.get_slice(name).get_shape()))

    def _read(self, name: str, read):
        """Apply `read` to the open shard holding `name`; a tensor the index names but the shard
        lacks (or a shard broken mid-file) becomes a one-line CheckpointError."""
        filename = self._file(name)
        try:
            return read(self._handle(filename))
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{self.path / filename}: cannot read tensor {name!r} ({exc})") from None

    def _file(self, name: str) -> str:
        try:
            return self.weight_map[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name!r} not in checkpoint") from None

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor, copied out of the memory map (so the file can be closed)."""
        tensor = self._read(name, lambda h: h.get_tensor(name))
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        return tensor

    def tensors(self, prefix: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """All tensors whose names start with `prefix` (e.g. 'model.layers.3.'), as `get` reads them."""
        return {k: self.get(k, dtype) for k in self.weight_map if k.startswith(prefix)}

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype `name` is stored in (from the safetensors header; no data is read)."""
        return _ST_DTYPES[self._entry(name)[2]["dtype"]]

    def mapped(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor as a view of the file's pages (mmap, copy-on-write), not a copy: it costs no
        anonymous memory; the pages it touches are page cache the kernel can drop and re-read.
        Only when `dtype` differs from the stored dtype is a converted copy made. Do not write
        to the view (it would copy the touched pages privately)."""
        mm, base, entry = self._entry(name)
        start, end = entry["data_offsets"]
        stored = _ST_DTYPES.get(entry["dtype"])
        if stored is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, which cannot be mapped")
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=end - start, offset=base + start) if end > start \
            else torch.empty(0, dtype=torch.uint8)
        if (base + start) % stored.itemsize:  # a view needs element alignment; copy the rare odd one
            raw = raw.clone()
        tensor = raw.view(stored).view(entry["shape"])
        if dtype is None or dtype == stored:
            return tensor
        converted = tensor.to(dtype)
        _drop_pages(mm, base + start, base + end)  # the source pages are not needed any more
        return converted

    def copy_and_drop(self, name: str) -> torch.Tensor:
        """One tensor copied out of its mapped pages, which are then dropped from this process (for
        a single pass over a checkpoint bigger than memory: RSS holds the copies, not the file)."""
        tensor = self.mapped(name).clone()
        self.drop_pages(name)
        return tensor

    def drop_pages(self, name: str) -> None:
        """Drop the pages of `name` that this process's mapping touched (re-read on the next access);
        views of it made earlier read the file again, they stay valid."""
        mm, base, entry = self._entry(name)
        start, end = entry["data_offsets"]
        _drop_pages(mm, base + start, base + end)

    def _entry(self, name: str) -> tuple[mmap.mmap, int, dict]:
        """(mmap of the shard holding `name`, its data offset, the tensor's header entry); a name the
        index lists but the shard lacks (reader made with verify=False) is a one-line CheckpointError."""
        filename = self._file(name)
        mm, base, header = self._map(filename)
        if name not in header:
            raise CheckpointError(f"{self.path / filename}: tensor {name!r} is listed in {INDEX_NAME} but not in "
                                  "this file; re-download the checkpoint")
        return mm, base, header[name]

    def _map(self, filename: str) -> tuple[mmap.mmap, int, dict]:
        """(mmap of the whole shard, offset of its data buffer, header) opened once per shard."""
        if filename not in self._maps:
            path = self.path / filename
            header = safetensors_header(path)
            with open(path, "rb") as f:
                base = 8 + int.from_bytes(f.read(8), "little")
                # ACCESS_COPY: a private, writable (so torch.frombuffer accepts it) mapping whose
                # untouched pages stay shared with the page cache.
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[filename] = (mm, base, header)
        return self._maps[filename]

    @cached_property
    def total_bytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in set(self.weight_map.values()))

    def num_parameters(self) -> int:
        return sum(math.prod(self.shape(name)) for name in self.weight_map)

    def close(self) -> None:
        """Drop the open shards. Mapped tensors keep their own mapping alive until they are freed."""
        self._handles.clear()
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
