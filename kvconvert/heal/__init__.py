"""Healing of converted MLA checkpoints: layer-wise reconstruction and distillation (docs/heal.md).

    from kvconvert.recipe import heal          # with a recipe (file, preset, built-in name or dict)
    from kvconvert.heal.api import heal_stages  # with the two stages' options (heal.options)

The package reads no recipe: kvconvert.recipe composes the stages' options and sits above it.
"""
