"""Choices of `kvconvert calibrate`, importable without torch (so `--help` stays fast)."""

KV_DTYPES = ("fp8", "fp8_e5m2", "nvfp4")
OBSERVERS = ("amax", "percentile", "mse")
GRANULARITIES = ("tensor", "head")
FORMATS = ("auto", "vllm", "modelopt", "both")
