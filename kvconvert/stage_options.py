"""One options model per stage (llm-compressor style): the pydantic model holds the fields, their
defaults, limits and help text; the recipe block is the model, the library function takes it, and
the click options are generated from it, so a default is written exactly once.

    @click.command("mla")
    @click_options(ConvertOptions)
    def mla_cmd(**params):
        opts = build_options(ConvertOptions, params)

Every generated option defaults to None ("not given") and the model fills in its own default, so
the CLI, the recipe and the API cannot disagree. Torch-free.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import click
from pydantic import BaseModel, ConfigDict, ValidationError

from kvconvert.errors import KVConvertError


class StageOptions(BaseModel):
    """Base of every stage's options: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation) -> Any:
    """(int | None) -> int; Literal stays Literal."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _option(name: str, field, flag: str | None = None):
    kind = _base_type(field.annotation)
    help_text = field.description or ""
    default = None if field.is_required() else field.get_default()
    if default is not None and not (kind is bool and default is False):
        help_text += f"  [default: {default}]"
    flag = flag or _flag(name)
    if kind is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help_text)
    if typing.get_origin(kind) is Literal:
        return click.option(flag, name, type=click.Choice([str(a) for a in typing.get_args(kind)]), default=None,
                            help=help_text)
    return click.option(flag, name, type=kind if kind in (int, float) else str, default=None, help=help_text)


def click_options(model: type[StageOptions], skip: tuple[str, ...] = (), flags: dict[str, str] | None = None):
    """Decorator: one click option per field of `model` (except `skip`), in field order."""
    flags = flags or {}

    def decorate(command):
        for name, field in reversed(list(model.model_fields.items())):
            if name not in skip:
                command = _option(name, field, flags.get(name))(command)
        return command
    return decorate


def build_options(model: type[StageOptions], params: dict, **fixed):
    """The model from a command's parameters (None = not given: the model's default) plus `fixed`
    values; a bad value becomes a KVConvertError naming the option."""
    given = {k: v for k, v in params.items() if k in model.model_fields and v is not None}
    try:
        return model(**given, **fixed)
    except ValidationError as exc:
        raise KVConvertError("; ".join(_describe(e) for e in exc.errors())) from None


def _describe(err: dict) -> str:
    msg = err["msg"].removeprefix("Value error, ")
    return f"{_flag(str(err['loc'][0]))}: {msg}" if err["loc"] else msg


def options_as_flags(opts: StageOptions, flags: dict[str, str] | None = None, keep: tuple[str, ...] = ()) -> list[str]:
    """The command-line flags that reproduce `opts` (values that differ from the defaults, and `keep`)."""
    flags = flags or {}
    out: list[str] = []
    for name, field in type(opts).model_fields.items():
        value = getattr(opts, name)
        if name not in keep and not field.is_required() and value == field.get_default():
            continue
        flag = flags.get(name, _flag(name))
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            out += [flag, str(value)]
    return out
