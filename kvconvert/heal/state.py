"""Reading a heal's saved progress (the state area beside `out`): a damaged file is named, with the way out.

A state file can be truncated or overwritten (a full disk, a copy cut short, a crash of the machine between
the write and the rename on a file system that does not order them). Each reader's own error (torch's
PytorchStreamReader or UnpicklingError, safetensors' SafetensorError, json's JSONDecodeError, EOFError on an
empty file) says nothing of which file or what to do; these say both."""

from __future__ import annotations

import json
from pathlib import Path

from kvconvert.errors import KVConvertError

RESTART_HINT = "rerun with --restart to discard the saved progress and start the heal again"


def damaged_state(path: Path, exc: BaseException | str) -> KVConvertError:
    why = exc if isinstance(exc, str) else f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return KVConvertError(f"{path}: saved progress of an interrupted heal is damaged ({why}); {RESTART_HINT}")


def read_json_state(path: Path) -> dict:
    """A JSON object saved in the state area."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise damaged_state(path, exc) from None
    if not isinstance(value, dict):
        raise damaged_state(path, f"holds {type(value).__name__}, not a JSON object")
    return value


def load_tensor_state(path: Path) -> dict:
    """A safetensors file saved in the state area."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (OSError, SafetensorError, ValueError) as exc:
        raise damaged_state(path, exc) from None


def load_torch_state(path: Path) -> dict:
    """A torch.save'd dict saved in the state area (weights_only: tensors, numbers, strings, nothing unpickled)."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - damaged bytes raise whatever they trip in the (weights-only)
        # unpickler: UnpicklingError, EOFError, RuntimeError, but also IndexError, KeyError, struct.error...
        raise damaged_state(path, exc) from None
    if not isinstance(state, dict):
        raise damaged_state(path, f"holds {type(state).__name__}, not a saved training state")
    return state
