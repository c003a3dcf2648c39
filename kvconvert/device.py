"""Where the heavy maths runs: one `--device` for mla, calibrate, validate, generate, heal and the pipeline.

    resolve_device("auto")    -> cuda when torch sees a GPU, else cpu
    resolve_device("cuda:1")  -> that GPU, or a KVConvertError saying it is not there

Torch is imported on use, so the options models (torch-free, for a fast `--help`) can share
DEVICE_FIELD.
"""

from __future__ import annotations

import os

from pydantic import Field

from kvconvert.errors import KVConvertError

DEVICE_FIELD = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                     description="Where the heavy maths runs: auto (cuda when a GPU is visible, else cpu), cpu, "
                                 "cuda or cuda:N.")


def default_device() -> str:
    """'cuda' when torch sees a GPU, else 'cpu'."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(spec=None):
    """"auto" / None / "cpu" / "cuda" / "cuda:N" (or a torch.device, e.g. meta in tests) -> torch.device.
    Asking for a GPU that is not there is a KVConvertError, never a silent fall back to the CPU."""
    import torch

    if spec is None or spec == "auto":
        spec = default_device()
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise KVConvertError(f"--device {spec!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise KVConvertError(f"--device {spec} asked for a GPU, but torch sees none (torch {torch.__version__}, "
                                 "CUDA build: " + str(torch.version.cuda) + "); use --device cpu, or install a "
                                 "CUDA build of torch on a machine with a GPU")
        if (device.index or 0) >= count:
            raise KVConvertError(f"--device {spec}: torch sees {count} GPU(s) (cuda:0..cuda:{count - 1}); pick one of them")
    elif device.type not in ("cpu", "meta"):
        raise KVConvertError(f"--device {spec}: only cpu and cuda are supported")
    return device


# --------------------------------------------------------------------------- processes

def launched_world_size() -> int:
    """How many processes a launcher (`accelerate launch`, torchrun) started this one among, from the
    variables they set in every process: WORLD_SIZE; without it, at least 2 when RANK or LOCAL_RANK
    names a process other than the first; else 1 (a plain run)."""
    def number(name: str) -> int | None:
        text = os.environ.get(name, "").strip()
        return int(text) if text.isdigit() else None

    world = number("WORLD_SIZE")
    if world is not None:
        return max(world, 1)
    return 2 if any((number(name) or 0) > 0 for name in ("RANK", "LOCAL_RANK")) else 1


# commands that run across the processes of a launcher (heal's distillation: DDP / FSDP, docs/heal.md)
MULTI_PROCESS_COMMANDS = frozenset({"heal"})
_INSTEAD = {  # what to run instead of a launched command, when more than "without the launcher"
    "mla": "; to heal across GPUs, convert without --heal in one process, then launch `kvconvert heal` on its output",
    "pipeline": "; to heal across GPUs, run the steps yourself: `kvconvert mla` (one process), then `accelerate launch "
                "... -m kvconvert.cli heal`, then `kvconvert calibrate`, `validate` and `gate` (one process each)",
}


def check_single_process(command: str) -> None:
    """Refuse a command that runs in one process when a launcher started several: each process would
    do the whole job and write the same output (two calibrations racing on one --out). `heal`
    (MULTI_PROCESS_COMMANDS) runs across them."""
    world = launched_world_size()
    if world <= 1 or command in MULTI_PROCESS_COMMANDS:
        return
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "?"
    raise KVConvertError(
        f"kvconvert {command} runs in one process, but a launcher (accelerate launch, torchrun) started it as process "
        f"{rank} of {world} (WORLD_SIZE={os.environ.get('WORLD_SIZE', 'unset')}): every process would do the whole job "
        f"and write the same output. Run `kvconvert {command} ...` (or `python -m kvconvert.cli {command} ...`) "
        f"without the launcher; only `kvconvert heal` runs across processes{_INSTEAD.get(command, '')}")
