"""Click options generated from a stage's pydantic options model (kvconvert.stage_options), so a
default, a limit and a help text are written once, in the model:

    @click.command("mla")
    @click_options(MLAOptions)
    def mla_cmd(**params):
        opts = build_options(MLAOptions, params)

Every generated option defaults to None ("not given") and the model fills in its own default, so
the CLI, the recipe and the API cannot disagree. Also the options every stage command shares.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Literal

import click

from kvconvert.errors import KVConvertError
from kvconvert.stage_options import StageOptions, base_type, option_flag, option_param


def _split_list(ctx, param, value):
    return None if value is None else tuple(v.strip() for v in value.split(",") if v.strip())


def _one_switch(ctx, param, value):
    """An on/off pair given once (or the same way twice): its value, None when not given; both ways is refused, not
    settled by whichever came last."""
    if not value:
        return None
    if len(set(value)) > 1:
        flag = param.opts[0]
        raise KVConvertError(f"{flag} and --no-{flag[2:]} were both given: pass one of them")
    return value[0]


def _option(field, name: str, prefix: str):
    """The click option of field `name` (see click_options)."""
    flag, param = option_flag(name, prefix), option_param(name, prefix)
    kind = base_type(field.annotation)
    help_text = field.description or ""
    default = None if field.is_required() else field.get_default()
    if isinstance(default, tuple):
        default = ",".join(map(str, default))
    if kind is bool and default is True:
        help_text += f"  [default: {flag[2:]}]"  # as click shows an on/off flag that is on
    elif default is not None and not (kind is bool and default is False):
        help_text += f"  [default: {default}]"
    if kind is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", param, multiple=True, default=None, callback=_one_switch,
                            help=help_text)
    if typing.get_origin(kind) is Literal:
        choices = click.Choice([str(a) for a in typing.get_args(kind)], case_sensitive=False)  # FP8 reads as fp8
        return click.option(flag, param, type=choices, default=None, help=help_text)
    if typing.get_origin(kind) is tuple:
        return click.option(flag, param, default=None, callback=_split_list, help=help_text + " (comma-separated)")
    return click.option(flag, param, type=kind if kind in (int, float) else str, default=None, help=help_text)


def click_options(model: type[StageOptions], prefix: str = ""):
    """Decorator: one click option per field of `model`, in field order; with `prefix`, field `steps`
    becomes --PREFIX-steps (parameter PREFIX_steps)."""
    def decorate(command):
        for name, field in reversed(list(model.model_fields.items())):
            command = _option(field, name, prefix)(command)
        return command
    return decorate


# --------------------------------------------------------------------------- options every stage command shares

def out_option(help_text: str, required: bool = True):
    """--out FOLDER (a Path) of a stage command."""
    return click.option("--out", "out", required=required, default=None,
                        type=click.Path(file_okay=False, path_type=Path), help=help_text)


threads_option = click.option("--threads", type=click.IntRange(min=1), default=None,
                              help="torch CPU threads (default: torch's choice; 1 is faster on a CPU shared with "
                                   "other jobs).")
no_progress_option = click.option("--no-progress", is_flag=True, help="No progress bars.")
overwrite_option = click.option("--overwrite", is_flag=True, help="Replace an existing --out folder.")
