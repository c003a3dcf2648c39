"""kvconvert.kernels: Triton kernels, each beside a pure-PyTorch reference (installed as kvconvert.kernels).

Public API (imported lazily, so ``import kvconvert.kernels`` neither needs nor loads Triton):
``paged_mla_decode``, ``paged_gqa_decode``, ``kv_append``, ``merge_lse`` (each with ``backend=
'triton' | 'torch'``) and the cache layouts ``MLACacheLayer`` / ``GQACacheLayer``.
Set TRITON_INTERPRET=1 before the first kernel import to run the kernels on CPU tensors.
"""

_PUBLIC = {
    "paged_mla_decode": "attention",
    "paged_gqa_decode": "attention",
    "kv_append": "attention",
    "merge_lse": "attention",
    "MLACacheLayer": "cache_layout",
    "GQACacheLayer": "cache_layout",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
