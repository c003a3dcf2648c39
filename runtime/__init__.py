"""kvconvert.runtime: a small paged-KV serving runtime (installed as kvconvert.runtime).

    from kvconvert.runtime import LLM, SamplingParams
"""

from kvconvert.runtime.config import EngineConfig, SamplingParams

__all__ = ["LLM", "EngineConfig", "Output", "SamplingParams"]


def __getattr__(name: str):
    """LLM and Output import torch: loaded on first use, so the torch-free parts (config, options: the flags
    of `kvconvert generate --help`) load fast."""
    if name in ("LLM", "Output"):
        from kvconvert.runtime import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'kvconvert.runtime' has no attribute {name!r}")
