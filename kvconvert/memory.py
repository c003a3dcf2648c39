"""The one memory model: what a run needs, by part, and the up-front check that refuses a run the machine
cannot hold (with the option that would fit) instead of letting it be killed halfway.

Each stage estimates its own need from config.json before any weight is read, and all of them return
the one type here:

    kvconvert.runtime.memory.estimate_memory    generate / validate: weights, KV pool, one step
    kvconvert.quant.memory.calibration_memory   calibrate: one streamed layer, one batch, the hidden states
    kvconvert.heal.memory.distill_memory        heal_distill: student + teacher, gradients, Adam, activations

    need = estimate_memory(config, torch.bfloat16, kv_cache_bytes=..., tokens_per_step=512, context=4096)
    check_memory(need, "kvconvert generate", hints=[("--dtype bf16", other_need)], device)

The capacity is the device's free memory (torch.cuda.mem_get_info) on a GPU, the smaller of MemAvailable
and the cgroup's headroom on the CPU, or $KVCONVERT_AVAILABLE_MEMORY when the user states it. Also here:
--dtype's names resolved to the weights' compute dtype (the names and bytes are kvconvert.kvformat's).
Floor module: torch, the standard library and kvconvert's floor modules only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import WEIGHT_DTYPE_NAMES, torch_dtype
from kvconvert.kvmath import parse_size

# What each stage adds for the process itself, before any tensor (interpreter, torch, transformers, the
# tokenizer; on a GPU the CUDA context and the caching allocator's slack), in bytes. They stay the
# values each estimate was measured against (docs/BENCHMARKS.md); the estimates carry them as `overhead`.
RUNTIME_OVERHEAD = 600 * 2**20  # generate / validate: ~0.5 GB RSS measured before any weight
CALIBRATE_OVERHEAD = 600 * 10**6  # calibrate: ~0.45 GB measured for SmolLM2 (x CALIBRATE_SAFETY below)
DISTILL_OVERHEAD = {"cuda": 2 << 30, "cpu": 1 << 30}  # heal_distill: + accelerate; RSS baseline 0.6-0.8 GB
CALIBRATE_SAFETY = 1.15  # calibrate counts temporaries as coexisting; this covers the allocator on top

# The user can state what the run may use (tests, containers whose limit we cannot read).
AVAILABLE_ENV = "KVCONVERT_AVAILABLE_MEMORY"
DTYPES = {"auto": None, **{name: torch_dtype(name) for name in WEIGHT_DTYPE_NAMES}}  # kvformat's table
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# describe()'s name of each byte part, in the order it lists them
LABELS = {"weights": "weights", "teacher_weights": "teacher weights", "kv_cache": "KV cache",
          "activations": "activations", "logits": "logits", "gradients": "gradients", "optimizer": "optimizer",
          "weight_copies": "weight copies", "gathered": "gathered FSDP unit", "buffers": "kept buffers"}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a run needs at its peak, by part (a stage leaves the parts it does not have at 0).

    total = safety x (every part + per_token x tokens + overhead)."""

    weights: int = 0  # the model's weights as resident (heal: the student's; calibrate: one streamed layer)
    teacher_weights: int = 0  # heal: the frozen teacher
    kv_cache: int = 0  # the KV cache pool (or transformers' cache)
    activations: int = 0  # one step's activations (heal: what autograd saves, and the kept hidden states)
    logits: int = 0  # heal: both models' logits, the loss's stored gradient and its chunk temporaries
    gradients: int = 0
    optimizer: int = 0  # Adam's two states (+ foreach Adam's temporaries)
    weight_copies: int = 0  # heal: what autograd saves of the weights (recomputed, or autocast's casts)
    gathered: int = 0  # heal under FSDP: one decoder layer of each model gathered whole
    buffers: int = 0  # calibrate: the mse search's kept windows and the observers' histograms
    per_token: int = 0  # bytes kept for every token the run is given (calibrate: the fp32 hidden states)
    tokens: int = 0
    overhead: int = 0  # the process before any tensor (RUNTIME_OVERHEAD, CALIBRATE_OVERHEAD, DISTILL_OVERHEAD)
    safety: float = 1.0  # multiplies the whole (calibrate: CALIBRATE_SAFETY)

    def parts(self) -> dict[str, int]:
        """The byte parts by field name (per_token x tokens and overhead not included)."""
        return {name: getattr(self, name) for name in LABELS}

    @property
    def fixed(self) -> int:
        """Bytes that do not grow with the tokens: every part and the overhead (before the safety factor)."""
        return sum(self.parts().values()) + self.overhead

    @property
    def allocated(self) -> int:
        """What the run itself allocates: without the overhead and the safety factor (what a measured peak
        above the process's baseline compares with)."""
        return self.fixed - self.overhead + self.per_token * self.tokens

    @property
    def total(self) -> int:
        need = self.fixed + self.per_token * self.tokens
        return need if self.safety == 1 else int(self.safety * need)

    def tokens_that_fit(self, available: int) -> int:
        """Most tokens that fit in `available` bytes (0: none, or tokens do not matter)."""
        if self.per_token <= 0:
            return 0
        return max(0, int((available / self.safety - self.fixed) / self.per_token))

    def describe(self) -> str:
        """'3.21 GB (weights 2.20 GB, KV cache 0.10 GB, ..., overhead 0.63 GB)': the total and its non-zero parts."""
        named = [f"{LABELS[name]} {gb(b)}" for name, b in self.parts().items() if b]
        if self.per_token and self.tokens:
            named.append(f"{self.tokens} tokens x {self.per_token} B {gb(self.per_token * self.tokens)}")
        if self.overhead:
            named.append(f"overhead {gb(self.overhead)}")
        if self.safety != 1:
            named.append(f"x {self.safety:g} allocator margin")
        return f"{gb(self.total)} ({', '.join(named)})"


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def available_memory(device: torch.device | str = "cpu") -> int:
    """Bytes this process may still use on `device`: for cuda the GPU's free memory; for the CPU
    the smaller of MemAvailable and the cgroup's headroom; $KVCONVERT_AVAILABLE_MEMORY (bytes, or a
    size such as 16G) when set."""
    env = os.environ.get(AVAILABLE_ENV)
    if env:
        return parse_size(env, bare_unit=1)
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":  # meta: nothing is allocated
        return 1 << 62
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else 1 << 62  # unknown (not Linux): do not refuse


def check_memory(need: MemoryEstimate, what: str, hints: list[tuple[str, MemoryEstimate]] = (),
                 device: torch.device | str = "cpu") -> None:
    """Refuse (KVConvertError) when `need` exceeds the available memory of `device`. hints: (option,
    estimate with that option) pairs; the first that fits is named in the message."""
    have = available_memory(device)
    if need.total <= have:
        return
    fits = next((option for option, alt in hints if alt.total <= have), None)
    advice = (f"use {fits}" if fits else
              "no option of this command fits: use a machine with more memory (or a GPU for the weights)")
    where = "" if torch.device(device).type == "cpu" else f" on {device}"
    raise KVConvertError(f"{what} needs about {need.describe()}, but only {gb(have)} is available{where}; {advice} "
                         f"(set {AVAILABLE_ENV} to override the available amount)")


def resolve_dtype(name: str | torch.dtype | None, stored: torch.dtype) -> torch.dtype:
    """--dtype auto|bf16|fp16|fp32 (or a torch dtype, None = auto) -> the weights' compute dtype.
    auto keeps what the checkpoint stores (non-float storage falls back to fp32)."""
    if isinstance(name, torch.dtype):
        dtype = name
    elif name is None or name in DTYPES:
        dtype = DTYPES.get(name or "auto")
    else:
        raise KVConvertError(f"--dtype {name!r} is unknown; choose one of {', '.join(DTYPES)}")
    if dtype is None:
        dtype = stored if stored in COMPUTE_DTYPES else torch.float32
    if dtype not in COMPUTE_DTYPES:
        raise KVConvertError(f"dtype {dtype} is not a compute dtype; choose bf16, fp16 or fp32")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bf16": the --dtype name of a compute dtype (kvconvert.kvformat's table)."""
    return next(name for name, d in DTYPES.items() if d == dtype)
