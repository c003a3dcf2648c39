"""`kvconvert plan`: for a KV byte budget, the artifact with the least measured damage, and its recipe
(kvconvert.plan)."""

from __future__ import annotations

from pathlib import Path

import click

from kvconvert.commands.options import click_options, overwrite_option
from kvconvert.plan import PlanOptions, parse_budget, removed_if_empty, run_plan
from kvconvert.sources import DEFAULT_MODEL
from kvconvert.stage_options import build_options


@click.command("plan")
@click.option("--src", default=DEFAULT_MODEL, show_default=True, help="Source model (folder or built-in name).")
@click.option("--kv-budget", "budget", required=True, help="KV bytes per token allowed, as a share of the source's "
                                                           "bf16 cache: 25% or 0.25.")
@click_options(PlanOptions)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("out/plan"), show_default=True)
@overwrite_option
def plan_cmd(src, budget, out_dir, overwrite, **params):
    """Pick the least-damage KV artifact that fits a byte budget: measured, with the recipe that builds it.

    An --out that holds a plan's files (plan.json, recipe.yaml, plan.md, plan.png) is refused unless --overwrite;
    the candidates' checkpoints under OUT/artifacts are reused where their provenance matches."""
    with removed_if_empty(out_dir):  # an interrupted or failed plan leaves no empty --out behind
        run_plan(src, parse_budget(budget), build_options(PlanOptions, params), out_dir, echo=click.echo,
                 overwrite=overwrite)
