"""Torch-free validation of safetensors headers (used by the lazy reader and by `inspect`/`budget`)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from kvconvert.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in the file at `path` (`what`: "config.json", ...), or a one-line CheckpointError:
    unreadable, not UTF-8 (JSON files are UTF-8; a Latin-1 byte or a binary file is refused here, not
    as a UnicodeDecodeError later), not valid JSON, or valid JSON that is not an object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: {what} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                              f"{exc.start}); save it as UTF-8 or restore the original file") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: unreadable {what} ({exc}); restore the original file") from None
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a string", type(None): "null", bool: "true/false"}.get(type(data), "a number")
        raise CheckpointError(f"{path}: {what} holds {kind}, not a JSON object ({{\"key\": value, ...}}); "
                              "restore the original file")
    return data


def index_weight_map(folder: Path) -> dict[str, str] | None:
    """{tensor name: shard file} of a sharded HF folder's index, every shard checked present;
    None when the folder has no index (a single model.safetensors, or no weights)."""
    index = folder / INDEX_NAME
    if not index.is_file():
        return None
    try:
        weight_map = dict(json.loads(index.read_text())["weight_map"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{index}: unreadable index ({exc})") from None
    for shard in sorted(set(weight_map.values())):
        if not (folder / shard).is_file():
            raise CheckpointError(f"{folder / shard}: shard named in {INDEX_NAME} is missing")
    return weight_map


def weight_files(folder: Path) -> list[Path]:
    """Safetensors files of an HF folder (index shards or model.safetensors); [] when it has none."""
    weight_map = index_weight_map(folder)
    if weight_map is not None:
        return [folder / s for s in sorted(set(weight_map.values()))]
    return [folder / SINGLE_NAME] if (folder / SINGLE_NAME).is_file() else []


def safetensors_header(path: Path) -> dict:
    """Header of one safetensors file {name: {dtype, shape, data_offsets}}, validated against the
    file size (catches truncation) without reading any tensor data.

    Layout: 8-byte little-endian header length N, N bytes of JSON, then the data buffer.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError("header length runs past the end of the file")
            header = json.loads(f.read(n))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
        for v in tensors.values():
            if not isinstance(v["dtype"], str) or math.prod(v["shape"]) < 0:
                raise ValueError("malformed tensor entry")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors file ({exc}); re-download or re-export it") from None
    if end != size - 8 - n:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header needs {end} data bytes, "
                              f"file has {size - 8 - n}); re-download or re-export it")
    return tensors
