"""Optional Triton import: the package imports without Triton; kernels raise a clear error instead.

Kernel modules define their ``@triton.jit`` functions under ``if HAS_TRITON:`` and every launcher
calls :func:`require_triton` and :func:`check_kernel_device` first.
"""

from __future__ import annotations

import os

import torch

from kvconvert.errors import KVConvertError

try:  # pragma: no cover - exercised by whichever environment runs the tests
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False

TRITON_MISSING = "Triton is not installed: pip install triton (or pass backend='torch')"


def require_triton() -> None:
    """Raise KVConvertError when Triton is not importable."""
    if not HAS_TRITON:
        raise KVConvertError(TRITON_MISSING)


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET=1: kernels then run on CPU tensors through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def check_kernel_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device: CUDA for compiled kernels, CPU for the interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise KVConvertError(f"kernel inputs are on several devices {sorted(map(str, devices))}: move them to one")
    device = devices.pop()
    if device.type == "cpu" and not interpreter_enabled():
        raise KVConvertError(
            "Triton kernels need GPU tensors: move the inputs to CUDA, set TRITON_INTERPRET=1 to run "
            "them on CPU (slow), or pass backend='torch'"
        )
    if device.type not in ("cpu", "cuda"):
        raise KVConvertError(f"Triton kernels run on CUDA (or CPU in the interpreter), not {device.type}")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
