"""Where the heavy maths runs: one `--device` for mla, calibrate, validate, generate, heal and the pipeline.

    resolve_device("auto")    -> cuda when torch sees a GPU, else cpu
    resolve_device("cuda:1")  -> that GPU, or a KVConvertError saying it is not there

Torch is imported on use, so the options models (torch-free, for a fast `--help`) can share
DEVICE_FIELD.
"""

from __future__ import annotations

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
