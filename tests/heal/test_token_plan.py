"""Tokens to a KL target (kvconvert.heal.token_plan): the log-space power-law fit recovers known curves,
its interval covers the truth, a floor above the target is never reached, and `kvconvert heal --plan`
runs the short distillations of a real (tiny) conversion and writes the plan and its picture."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import yaml
from heal_cases import distill_recipe

from kvconvert.heal.token_plan import fit_power_law, hours, tokens_to_reach

BUDGETS = np.array([8192, 16384, 32768, 65536, 131072], dtype=np.float64)


def curve(t, a=3.0, b=0.35, c=0.02):
    return a * t ** -b + c


def test_the_fit_recovers_an_exact_power_law_with_a_floor():
    fit = fit_power_law(BUDGETS, curve(BUDGETS))
    assert fit.a == pytest.approx(3.0, rel=1e-4) and fit.b == pytest.approx(0.35, rel=1e-4)
    assert fit.c == pytest.approx(0.02, rel=1e-3)
    assert fit.tokens_for(0.05) == pytest.approx((3.0 / 0.03) ** (1 / 0.35), rel=1e-3)
    assert tokens_to_reach(3.0, 0.35, 0.02, 0.02) == math.inf  # the floor itself is never reached


def test_three_budgets_go_through_the_points_with_the_evaluation_noise_as_uncertainty():
    t = BUDGETS[:3]
    y = curve(t) * np.array([1.01, 0.99, 1.005])
    fit = fit_power_law(t, y, 0.01 * y)
    assert np.allclose(fit.kl(t), y, rtol=1e-6) and fit.dof == 0
    assert set(fit.errors()) == {"a", "b", "c"}
    assert fit_power_law(t, y).cov is None  # no error bars and no spare point: nothing bounds it


def test_the_interval_covers_the_truth_about_as_often_as_it_says():
    """Noisy measurements (2% error bars) of a known curve at 5 budgets, 60 times: the 16-84% band of the
    tokens to KL 0.05 holds the true value in roughly 68% of the trials (40-90% allowed: 60 trials)."""
    truth = (3.0 / 0.03) ** (1 / 0.35)
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(60):
        y = curve(BUDGETS) * (1 + 0.02 * rng.standard_normal(len(BUDGETS)))
        band = fit_power_law(BUDGETS, y, 0.02 * y).interval(0.05, draws=1000)
        hits += band["p16"] <= truth <= band["p84"]
    assert 0.4 <= hits / 60 <= 0.9, hits


def test_hours():
    assert hours(3.6e6, 1000.0, 4) == {"wall_h": 0.25, "device_h": 1.0}
    assert hours(math.inf, 1000.0, 1)["device_h"] == math.inf


def test_bad_points_are_refused():
    with pytest.raises(ValueError, match="three or more"):
        fit_power_law([1, 2], [0.5, 0.4])


def test_heal_plan_cli_measures_fits_and_writes_the_plan(tiny_student, tiny_teacher, text_file, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(distill_recipe(text_file, checkpoint_every=0, warmup_steps=1)))
    out = tmp_path / "plan"
    done = subprocess.run(
        [sys.executable, "-m", "kvconvert.cli", "heal", "--student", tiny_student, "--teacher", tiny_teacher,
         "--recipe", recipe, "--out", out, "--plan", "--plan-budgets", "256,512,1024", "--plan-kl-target", "0.5",
         "--plan-devices", "2", "--plan-eval-windows", "3", "--plan-eval-window", "64", "--no-progress",
         "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads((out / "heal_plan.json").read_text())
    assert [p["tokens"] for p in plan["points"]] == [256, 512, 1024]
    assert all(p["kl"] > 0 and p["kl_se"] > 0 for p in plan["points"])
    assert plan["target"]["devices"] == 2 and plan["target"]["speeds"][0]["tokens_per_s"] > 0
    assert (out / "heal_plan.png").stat().st_size > 10_000
    assert "to KL 0.5:" in done.stdout and "device-hours" in done.stdout
    assert not list(tmp_path.glob(".plan.*"))  # the short runs' folder is gone
