"""Healing of converted MLA checkpoints: layer-wise reconstruction and distillation (docs/heal.md).

    from kvconvert.heal import heal
"""


def heal(*args, **kwargs):
    """See kvconvert.heal.api.heal (imported lazily: torch/transformers load only when used)."""
    from kvconvert.heal.api import heal as _heal

    return _heal(*args, **kwargs)


__all__ = ["heal"]
