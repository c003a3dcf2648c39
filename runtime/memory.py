"""Up-front memory checks: estimate what a run needs from config.json alone, before any weight is read,
and refuse with a clear message (and the option that would fit) instead of being killed halfway.

    need = estimate_memory(config, weight_dtype=torch.bfloat16, kv_cache_bytes=..., tokens_per_step=512,
                           context=4096)
    check_memory(need, "kvconvert generate", hints=[...])   # KVConvertError when it cannot fit

The estimate is deliberately simple and a little pessimistic: weights at the chosen dtype (mapped
bf16 weights still become resident as page cache when a forward touches them), the KV cache pool,
the largest per-step activations, and a fixed allowance for the interpreter, torch and the tokenizer
(on a GPU it stands for the CUDA context and the allocator's slack). On a GPU the whole estimate is
checked against the device's free memory (torch.cuda.mem_get_info), on the CPU against RAM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import WEIGHT_DTYPE_NAMES, torch_dtype
from kvconvert.kvmath import parameter_count

KEEP_FP32_HEAD = 1 << 28  # a 16-bit lm_head whose fp32 copy is at most this is upcast once, not every step

# Python + torch + transformers' tokenizer, measured here: about 0.5 GB RSS before any weight.
BASE_BYTES = 600 * 2**20
# The user can state what the run may use (tests, containers whose limit we cannot read).
AVAILABLE_ENV = "KVCONVERT_AVAILABLE_MEMORY"
DTYPES = {"auto": None, **{name: torch_dtype(name) for name in WEIGHT_DTYPE_NAMES}}  # kvformat's table


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    activations: int
    base: int = BASE_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.base

    def describe(self) -> str:
        return (f"{gb(self.total)} (weights {gb(self.weights)}, KV cache {gb(self.kv_cache)}, "
                f"activations {gb(self.activations)}, runtime {gb(self.base)})")


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def estimate_memory(config: dict, weight_dtype: torch.dtype, kv_cache_bytes: int = 0, tokens_per_step: int = 2048,
                    context: int = 2048) -> MemoryEstimate:
    """Bytes a forward-only run of the model in `config` needs (pure: config and numbers in, no I/O).

    weights: every parameter at weight_dtype's size. activations, for one step of tokens_per_step
    tokens attending to at most `context` positions (fp32 upper bounds):
      residual, normed input, q/k/v, attention output   ~ 6 x hidden per token
      gate, up, act(gate) * up                          ~ 3 x intermediate per token
      attention scores of one layer                     heads x tokens x context
      logits and their log-softmax (scoring every row)  2 x vocab per token
    """
    hidden = config["hidden_size"]
    inter = config.get("intermediate_size") or 4 * hidden
    heads = config["num_attention_heads"]
    t = tokens_per_step
    weights = parameter_count(config) * torch.finfo(weight_dtype).bits // 8
    head_fp32 = 4 * config["vocab_size"] * hidden  # a 16-bit lm_head's fp32 copy, kept when small (layers.upcast_chunks)
    if weight_dtype != torch.float32 and head_fp32 <= KEEP_FP32_HEAD:
        weights += head_fp32
    per_token = 6 * hidden + 3 * inter + 2 * config["vocab_size"]
    activations = 4 * (t * per_token + heads * t * min(context, config.get("max_position_embeddings") or context))
    return MemoryEstimate(weights=weights, kv_cache=kv_cache_bytes, activations=activations)


def available_memory(device: torch.device | str = "cpu") -> int:
    """Bytes this process may still use on `device`: for cuda the GPU's free memory; for the CPU
    the smaller of MemAvailable and the cgroup's headroom; $KVCONVERT_AVAILABLE_MEMORY (bytes, or a
    size such as 16G) when set."""
    env = os.environ.get(AVAILABLE_ENV)
    if env:
        from kvconvert.kvmath import parse_size

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
        dtype = stored if stored in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise KVConvertError(f"dtype {dtype} is not a compute dtype; choose bf16, fp16 or fp32")
    return dtype
