"""kvconvert: shrink the KV cache on the model side and prove the result."""

__version__ = "0.1.0"
