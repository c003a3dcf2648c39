"""Healing of converted MLA checkpoints: layer-wise reconstruction and distillation (docs/heal.md).

    from kvconvert.heal import heal, heal_after_convert
"""


def heal(*args, **kwargs):
    """See kvconvert.heal.api.heal (imported lazily: torch/transformers load only when used)."""
    from kvconvert.heal.api import heal as _heal

    return _heal(*args, **kwargs)


def heal_after_convert(student_dir, teacher_dir, recipe_or_preset, out_dir, **kwargs):
    """See kvconvert.heal.api.heal_after_convert."""
    from kvconvert.heal.api import heal_after_convert as _heal_after_convert

    return _heal_after_convert(student_dir, teacher_dir, recipe_or_preset, out_dir, **kwargs)


__all__ = ["heal", "heal_after_convert"]
