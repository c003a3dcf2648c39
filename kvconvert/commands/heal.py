"""`kvconvert heal`: heal a converted MLA checkpoint against its source model (kvconvert.recipe.heal)."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import click

from kvconvert.commands.options import click_options, no_progress_option, out_option, overwrite_option, threads_option
from kvconvert.errors import KVConvertError
from kvconvert.heal.options import DistillOptions, HealPlanOptions, LayerwiseOptions
from kvconvert.stage_options import build_options, given_options

# recipe block, its options model, the prefix of its flags (--layerwise-steps, --distill-lr)
HEAL_BLOCKS = (("heal_layerwise", LayerwiseOptions, "layerwise"), ("heal_distill", DistillOptions, "distill"))


@click.command("heal")
@click.option("--student", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Converted MLA checkpoint folder (output of `kvconvert mla`), or a model of the teacher's own "
                   "architecture to heal for its KV cache (--distill-kv-dtype; e.g. the source itself, a folder or "
                   "built-in name).")
@click.option("--teacher", required=True, help="The source it was converted from: HF folder or built-in name.")
@click.option("--recipe", required=True,
              help="Recipe YAML (heal_layerwise / heal_distill blocks) or a preset: layerwise, layerwise+distill, "
                   "distill (a model of the teacher's own architecture healed for its cache). "
                   "--layerwise-* / --distill-* flags replace single keys of its blocks.")
@click_options(LayerwiseOptions, prefix="layerwise")
@click_options(DistillOptions, prefix="distill")
@click.option("--plan", is_flag=True, help="Instead of healing: distil at a few short budgets (--plan-budgets), fit "
                                          "KL against tokens and print the tokens and hours to --plan-kl-target; "
                                          "writes heal_plan.json and heal_plan.png to --out.")
@click_options(HealPlanOptions, prefix="plan")
@out_option("Output folder (stock DeepSeek-V3 checkpoint).")
@overwrite_option
@click.option("--restart", is_flag=True, help="Discard saved progress instead of resuming it.")
@click.option("--allow-other-teacher", is_flag=True,
              help="Heal against a --teacher whose weights are not the ones the student was converted from (its "
                   "manifest's source); refused without it.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Stop distillation after this many steps and keep its state (rerun to resume).")
@click.option("--device", default=None, help="Device of both stages and the teacher's data, replacing --layerwise-device / "
                                            "--distill-device and the recipe's (default: each block's own, auto).")
@threads_option
@no_progress_option
def heal_cmd(student, teacher, recipe, out, overwrite, restart, allow_other_teacher, max_steps, device, threads,
             no_progress, plan, **params):
    """Recover the quality lost by MLA conversion: layer-wise reconstruction of each attention block,
    then end-to-end distillation (KL to the source); with --distill-kv-dtype the student reads its KV cache as the
    engine stores it (any student, the source itself included). Resumes after an interruption."""
    import torch

    recipe = recipe_with_flags(recipe, params)
    plan_opts = build_options(HealPlanOptions, params, "plan")
    if threads:
        torch.set_num_threads(threads)
    with process_group_released():
        _heal(student, teacher, recipe, out, overwrite, restart, allow_other_teacher, max_steps, device, no_progress,
              plan, plan_opts)
    end_launched_process()


def _heal(student, teacher, recipe, out, overwrite, restart, allow_other_teacher, max_steps, device, no_progress, plan,
          plan_opts) -> None:
    from kvconvert.recipe import heal

    if plan:
        from kvconvert.heal.token_plan import plan_heal
        from kvconvert.recipe import with_heal_device

        plan_heal(student, teacher, with_heal_device(recipe, device), out, plan_opts, overwrite=overwrite,
                  progress=not no_progress, echo=click.echo)
        click.echo(f"wrote {out / 'heal_plan.json'} and {out / 'heal_plan.png'}")
        return
    report = heal(student, teacher, recipe, out, overwrite=overwrite, progress=not no_progress, restart=restart,
                  max_steps=max_steps, device=device, allow_other_teacher=allow_other_teacher)
    if not report.get("finished", True):
        d = report["stages"]["heal_distill"]
        click.echo(f"stopped at step {d['steps_done']}/{d['steps']}; rerun the same command to resume")
        return
    if lw := report["stages"].get("heal_layerwise"):
        click.echo(f"layer-wise: mean block rel. error {lw['mean_rel_err_before']:.4f} -> {lw['mean_rel_err_after']:.4f} "
                   f"({lw['seconds']:.0f} s)")
    if ds := report["stages"].get("heal_distill"):
        click.echo(f"distill: {ds['steps_done']} steps, {ds.get('tokens', 0)} tokens, loss "
                   f"{ds.get('loss_first', float('nan')):.4f} -> {ds.get('loss_last', float('nan')):.4f}, "
                   f"{ds.get('tokens_per_s', 0):.0f} tok/s")
    click.echo(f"wrote {out} ({json.dumps(report.get('seconds'))} s)")


@contextmanager
def process_group_released():
    """Under `accelerate launch`, destroy the process group once the heal has returned on this process. Left to
    interpreter exit, gloo's worker threads can still hold tensors while Python tears down, and the process ends in
    SIGABRT ("terminate called without an active exception") after a heal that succeeded. Only on success: a
    process that raised may leave its peers inside a collective, where a collective teardown would hang."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_launched_process() -> None:
    """In a launched process (torchrun / `accelerate launch` set WORLD_SIZE > 1) whose heal returned: flush stdio and
    end it without the interpreter's teardown. With the group destroyed a rank still ended in SIGABRT ("terminate
    called without an active exception", a C++ thread's destructor during teardown) after a `--max-steps` stop had
    written its state, now and then under CI's load; the launcher then fails the whole run. Everything the heal
    writes is on disk by then (atomic renames), so nothing is lost by skipping teardown. A single process returns."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def recipe_with_flags(recipe: str, params: dict):
    """The recipe (file or preset) with the keys the --layerwise-* / --distill-* flags give replaced."""
    from kvconvert.recipe import parse_recipe, resolve_recipe

    resolved = resolve_recipe(recipe)
    data = resolved.to_dict()
    for block, model, prefix in HEAL_BLOCKS:
        given = given_options(model, params, prefix)
        if not given:
            continue
        if resolved.stage(block) is None:
            flags = ", ".join(f"--{prefix}-{k.replace('_', '-')}" for k in given)
            raise KVConvertError(f"{flags}: the recipe {recipe} has no enabled {block} block to change; add one "
                                 f"to the recipe{' or use --recipe layerwise+distill' if prefix == 'distill' else ''}")
        build_options(model, params, prefix, base={k: v for k, v in data[block].items() if k != "enabled"})
        data[block] = {**data[block], **given}
    return parse_recipe(data, str(recipe)) if data != resolved.to_dict() else resolved
