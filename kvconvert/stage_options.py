"""One options model per stage (llm-compressor style): the pydantic model holds the fields, their
defaults, limits and help text; the recipe block is the model, the library function takes it, and
the command's flags are generated from it (kvconvert.commands.options), so a default is written
exactly once. build_options turns the flags' values (None = not given) into the model and a bad
value into a KVConvertError that names the flag. Torch-free and click-free.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, field_validator
from pydantic.fields import FieldInfo

from kvconvert.errors import KVConvertError
from kvconvert.text_sources import mix_text, parse_mix


class StageOptions(BaseModel):
    """Base of every stage's options: unknown keys are errors, values are immutable, and a number is never
    a bool (pydantic's lax mode reads `calib_tokens: true` as 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _bool_is_not_a_number(cls, value, info):
        kind = base_type(cls.model_fields[info.field_name].annotation)
        if isinstance(value, bool) and kind in (int, float):
            raise ValueError(f"{str(value).lower()} is a bool, not {'a count' if kind is int else 'a number'}; give "
                             f"{'a whole number' if kind is int else 'a number'}")
        return value


def text_source_help(*extra: str) -> str:
    """The help of a stage's text-source option (kvconvert.text_sources reads them all): the built-in
    sources, `extra` ones the stage adds, then files, folders and datasets ids, and mixes."""
    return ", ".join(["builtin (pydoc)", "wiki (SQuAD's Wikipedia paragraphs)", *extra,
                      "a .txt/.jsonl/.parquet file or a folder of them, or a datasets id (ORG/NAME[:CONFIG], "
                      "streamed); A+B mixes equal shares (pydoc+wiki), 0.7*A+0.3*B weighted ones ({A: 0.7, B: 0.3} "
                      "in a recipe)."])


def _valid_mix(value: str | dict) -> str | dict:
    parse_mix(value)  # ValueError: pydantic names the field
    return value


# a text source or a weighted mix of them ({A: 0.7, B: 0.3}); the flag takes the string forms
TextMix = Annotated[str | dict[str, float], AfterValidator(_valid_mix)]


def option_flag(name: str, prefix: str = "") -> str:
    """The command-line flag of field `name` (--calib-tokens; --PREFIX-steps with a prefix)."""
    return "--" + option_param(name, prefix).replace("_", "-")


def option_param(name: str, prefix: str = "") -> str:
    """The parameter of field `name` in a command: `prefix_name` when the command holds several models."""
    return f"{prefix}_{name}" if prefix else name


def base_type(annotation) -> Any:
    """(int | None) -> int; Literal and tuple[...] stay as they are."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def field_like(field: FieldInfo, **changes) -> FieldInfo:
    """`field` (a stage model's, or a shared one like DEVICE_FIELD) with `changes` (default, description):
    for an option that sets that field from another command (the pipeline's --rank is the conversion's
    rank), so its limits are written once."""
    return FieldInfo.merge_field_infos(field, **changes)


def given_options(model: type[StageOptions], params: dict, prefix: str = "") -> dict:
    """{field: value} of the options the command line gave (None = not given)."""
    return {name: params[option_param(name, prefix)] for name in model.model_fields
            if params.get(option_param(name, prefix)) is not None}


def build_options(model: type[StageOptions], params: dict, prefix: str = "", base: dict | None = None, **fixed):
    """The model from a command's parameters (None = not given: `base`'s value, else the model's
    default) plus `fixed` values; a bad value becomes a KVConvertError naming the option."""
    values = {**(base or {}), **given_options(model, params, prefix), **fixed}
    try:
        return model(**values)
    except ValidationError as exc:
        raise KVConvertError("; ".join(_describe(e, prefix) for e in exc.errors())) from None


def _describe(err: dict, prefix: str = "") -> str:
    msg = err["msg"].removeprefix("Value error, ")
    return f"{option_flag(str(err['loc'][0]), prefix)}: {msg}" if err["loc"] else msg


def options_as_flags(opts: StageOptions, keep: tuple[str, ...] = ()) -> list[str]:
    """The command-line flags that reproduce `opts` (values that differ from the defaults, and `keep`)."""
    out: list[str] = []
    for name, field in type(opts).model_fields.items():
        value = getattr(opts, name)
        if name not in keep and not field.is_required() and value == field.get_default():
            continue
        flag = option_flag(name)
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, tuple):
            out += [flag, ",".join(map(str, value))]
        elif isinstance(value, dict):  # a weighted text mix
            out += [flag, mix_text(value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


# --------------------------------------------------------------------------- YAML files (recipes, gate policies)

def read_yaml(path: str | Path, missing: str = "file not found"):
    """The parsed YAML file at `path`. A missing file is a KVConvertError "PATH: `missing`", a file
    that is not UTF-8 text (a binary file, a stray Latin-1 byte) one that names the byte, bad YAML
    one that names the line."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise KVConvertError(f"{path}: {missing}")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise KVConvertError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                             "a recipe or policy is a UTF-8 YAML file: save it as UTF-8 or pass the right file") from None
    except OSError as exc:
        raise KVConvertError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise KVConvertError(f"{path}: not valid YAML{where}") from None


def validation_problems(exc: ValidationError, model: type[BaseModel], most: int = 3) -> str:
    """The first `most` problems of validating `model` from YAML, each naming the key as written there."""
    problems = "; ".join(_describe_key(e, model) for e in exc.errors()[:most])
    return problems + (f" (+{exc.error_count() - most} more)" if exc.error_count() > most else "")


def _describe_key(err: dict, model: type[BaseModel]) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        allowed = allowed_keys(model, err["loc"][:-1])
        return f"unknown key {loc!r}" + (f" (allowed here: {', '.join(allowed)})" if allowed else "")
    if err["type"] == "missing":
        return f"missing key {loc!r}"
    got = "" if isinstance(err.get("input"), (dict, list)) else f" (got {err.get('input')!r})"
    return f"{loc}: {err['msg'].removeprefix('Value error, ')}{got}"


def allowed_keys(model: type[BaseModel], parent: tuple) -> list[str]:
    """The keys the block at `parent` (a path of keys from `model`) accepts, as written in YAML (aliases)."""
    for part in parent:
        fields = {f.alias or name: f for name, f in model.model_fields.items()}
        if part not in fields:
            return []
        args = [a for a in typing.get_args(fields[part].annotation) if isinstance(a, type)] or [fields[part].annotation]
        model = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return []
    return [f.alias or name for name, f in model.model_fields.items()]
