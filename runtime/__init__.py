"""kvconvert.runtime: a small paged-KV serving runtime (installed as kvconvert.runtime).

    from kvconvert.runtime import LLM, SamplingParams
"""

from kvconvert.runtime.config import EngineConfig, SamplingParams
from kvconvert.runtime.llm import LLM, Output

__all__ = ["LLM", "EngineConfig", "Output", "SamplingParams"]
