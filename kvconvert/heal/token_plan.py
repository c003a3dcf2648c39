"""Tokens to a KL target, measured before the run (`kvconvert heal --plan`).

A few short distillations of the user's own conversion (the recipe's heal_distill block at budgets of
T tokens, e.g. 8K / 16K / 32K, each a whole run with its own schedule) give the held-out KL(source ||
healed) at each T. They are fitted with a power law with a floor,

    KL(T) = a T^-b + c,       in log space: min sum_i ((ln KL_i - ln KL(T_i)) / s_i)^2,

where s_i = se(KL_i) / KL_i is each point's relative standard error over the evaluation windows (the
KL's noise). The covariance of (ln a, b, c) is the inverse of J^T J at the optimum (J: the weighted
residuals' Jacobian), scaled by the reduced chi-square when there are more budgets than parameters
and it exceeds 1. With exactly three budgets the curve goes through them and the uncertainty is the
evaluation noise alone: more budgets add the model's misfit.

Tokens to reach a target t: T* = (a / (t - c))^(1/b) (never, when t <= c: the floor is above the
target). Its interval comes from parameters drawn from the fit's Gaussian (16th / 50th / 84th
percentiles of T*, and the share of draws whose floor is below the target). Hours = T* / (tokens/s
per device x devices): the speed measured in the short runs, and kvconvert.heal.memory's measured
GPU speeds for a teacher of this size. A plan extrapolates far beyond the measured budgets (8K ->
billions): the interval says how far the data constrains it, not how right a power law is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z_16_84 = (16, 50, 84)  # percentiles reported (a 1-sigma band and the median)


@dataclass(frozen=True)
class PowerLawFit:
    """KL(T) = a T^-b + c; cov: covariance of (ln a, b, c), None when nothing bounds it."""

    a: float
    b: float
    c: float
    cov: np.ndarray | None
    dof: int  # budgets minus 3

    def kl(self, tokens) -> np.ndarray:
        return self.a * np.asarray(tokens, dtype=np.float64) ** -self.b + self.c

    def tokens_for(self, target: float) -> float:
        return tokens_to_reach(self.a, self.b, self.c, target)

    def errors(self) -> dict:
        """Standard errors of a, b, c (a's by the delta method from ln a)."""
        if self.cov is None:
            return {}
        se = np.sqrt(np.clip(np.diag(self.cov), 0, None))
        return {"a": float(self.a * se[0]), "b": float(se[1]), "c": float(se[2])}

    def interval(self, target: float, draws: int = 4000, seed: int = 0) -> dict:
        """Percentiles of the tokens to reach `target` over parameter draws, and the share that reach it."""
        best = self.tokens_for(target)
        if self.cov is None:
            return {"p16": best, "p50": best, "p84": best, "reachable": float(math.isfinite(best))}
        rng = np.random.default_rng(seed)
        theta = rng.multivariate_normal([math.log(self.a), self.b, self.c], self.cov, size=draws, method="eigh")
        t = np.array([_tokens_from_log_a(la, b, c, target) for la, b, c in theta])
        p16, p50, p84 = np.percentile(t, Z_16_84, method="inverted_cdf")  # a draw's own value: inf = never
        return {"p16": float(p16), "p50": float(p50), "p84": float(p84), "reachable": float(np.isfinite(t).mean())}


def tokens_to_reach(a: float, b: float, c: float, target: float) -> float:
    return _tokens_from_log_a(math.log(a), b, c, target) if a > 0 else math.inf


def _tokens_from_log_a(log_a: float, b: float, c: float, target: float) -> float:
    """T* = (a / (t - c))^(1/b), from ln a (a draw's ln a can be far beyond a float's range)."""
    if b <= 0 or target <= c:
        return math.inf
    log_t = (log_a - math.log(target - c)) / b
    return math.exp(log_t) if log_t < 700 else math.inf


def fit_power_law(tokens, kl, kl_se=None) -> PowerLawFit:
    """The log-space least-squares fit of KL(T) = a T^-b + c (b > 0, c >= 0) to measured points.

    kl_se: each point's standard error (None: equal weights, and no uncertainty from 3 points)."""
    from scipy.optimize import least_squares

    t = np.asarray(tokens, dtype=np.float64)
    y = np.asarray(kl, dtype=np.float64)
    if len(t) < 3 or np.any(y <= 0) or len(set(t.tolist())) < 3:
        raise ValueError("a power law with a floor needs positive KL at three or more distinct budgets")
    s = np.ones_like(y) if kl_se is None else np.maximum(np.asarray(kl_se, dtype=np.float64) / y, 1e-6)

    def residuals(theta):
        return (np.log(y) - np.log(np.exp(theta[0]) * t ** -theta[1] + theta[2])) / s

    best = None
    for c0 in (1e-9 * y.min(), 0.5 * y.min(), 0.9 * y.min()):  # starts: ln(KL - c) linear in ln T
        slope, intercept = np.polyfit(np.log(t), np.log(y - c0), 1)
        start = [intercept, max(-slope, 1e-3), c0]
        fit = least_squares(residuals, start, bounds=([-np.inf, 1e-4, 0.0], [np.inf, 10.0, y.min()]),
                            x_scale="jac")
        if best is None or fit.cost < best.cost:
            best = fit
    dof = len(t) - 3
    cov = None
    if kl_se is not None or dof > 0:
        j = best.jac
        cov = np.linalg.pinv(j.T @ j)
        chi2 = float(np.sum(best.fun ** 2))
        if dof > 0:  # the points scatter more than their error bars: widen (or, unweighted, estimate) them
            cov = cov * (max(1.0, chi2 / dof) if kl_se is not None else chi2 / dof)
    la, b, c = best.x
    return PowerLawFit(float(math.exp(la)), float(b), float(c), cov, dof)


def hours(tokens: float, tokens_per_s: float, devices: int) -> dict:
    """Wall-clock hours on `devices` (data-parallel, ideal scaling) and device-hours."""
    if not math.isfinite(tokens):
        return {"wall_h": math.inf, "device_h": math.inf}
    device_h = tokens / tokens_per_s / 3600
    return {"wall_h": device_h / devices, "device_h": device_h}


def plot_fit(points: list[dict], fit: PowerLawFit, target: float, reach: dict, path, title: str) -> None:
    """Measured KL (with error bars) against tokens, the fitted curve extended to the target, and the
    predicted tokens with its interval (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.array([p["tokens"] for p in points], dtype=np.float64)
    y = np.array([p["kl"] for p in points])
    err = np.array([p.get("kl_se", 0.0) for p in points])
    right = reach["p50"] if math.isfinite(reach["p50"]) else t.max() * 1e3
    grid = np.geomspace(t.min() / 2, max(right * 2, t.max() * 4), 200)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    ax.errorbar(t, y, yerr=err, fmt="o", color="C0", capsize=3, label="measured (held-out KL, ±1 s.e.)")
    ax.plot(grid, fit.kl(grid), color="C1",
            label=f"fit: {fit.a:.3g} T^-{fit.b:.3g} + {fit.c:.3g}")
    ax.axhline(target, color="C3", lw=0.8, ls="--", label=f"target KL {target:g}")
    if fit.c > 0:
        ax.axhline(fit.c, color="C1", lw=0.6, ls=":", label=f"fitted floor c = {fit.c:.3g}")
    if math.isfinite(reach["p50"]) and reach["p50"] > 0:  # 0: reached before distillation (no point on log axes)
        lo = reach["p16"] if math.isfinite(reach["p16"]) else reach["p50"]
        hi = reach["p84"] if math.isfinite(reach["p84"]) else grid.max()
        ax.axvspan(lo, hi, color="C3", alpha=0.12, label="tokens to target (16-84%)")
        ax.axvline(reach["p50"], color="C3", lw=1.0)
    ax.set(xscale="log", yscale="log", xlabel="distillation tokens T", ylabel="KL(source || healed), nats/token",
           title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- the measured short runs

@dataclass(frozen=True)
class _Stages:
    """heal.options.HealStages of one short run."""

    layerwise: object | None
    distill: object | None

    def to_dict(self) -> dict:
        return {name: opts.model_dump() for name, opts in (("heal_layerwise", self.layerwise),
                                                          ("heal_distill", self.distill)) if opts is not None}


def run_tokens(distill, tokens: int) -> int:
    """The tokens a short run of `tokens` trains on: whole optimizer steps of distill.tokens_per_step (one at least)."""
    return max(1, tokens // distill.tokens_per_step) * distill.tokens_per_step


def distinct_run_budgets(distill, budgets) -> tuple[int, ...]:
    """The budgets as the short runs will train them, refused before any run unless three or more stay distinct
    (the power law with a floor has three parameters)."""
    from kvconvert.errors import KVConvertError

    runs = tuple(dict.fromkeys(run_tokens(distill, t) for t in budgets))
    if len(runs) < 3:
        rounded = ", ".join(f"{t} -> {run_tokens(distill, t)}" for t in budgets)
        raise KVConvertError(f"heal --plan: the budgets round to whole steps of {distill.tokens_per_step} tokens "
                             f"(batch_size x seq_len x grad_accum): {rounded}, {len(runs)} distinct; give three or "
                             f"more budgets that differ by at least one step")
    return runs


def check_eval_window(student_cfg: dict, window: int) -> None:
    """Refuse held-out windows longer than the model's positions (its RoPE was never trained there)."""
    from kvconvert.errors import KVConvertError

    limit = student_cfg.get("max_position_embeddings")
    if limit and window > limit:
        raise KVConvertError(f"--plan-eval-window {window} is beyond the model's max_position_embeddings {limit}: "
                             f"use {limit} or less")


def budget_stage(distill, tokens: int):
    """The recipe's distillation at `tokens`: a whole run with its own schedule, the warm-up the same share
    of its steps as the recipe's, no intermediate snapshots."""
    steps = max(1, tokens // distill.tokens_per_step)
    warmup = round(distill.warmup_steps * steps / distill.steps)
    return type(distill)(**{**distill.model_dump(), "tokens": tokens, "warmup_steps": warmup, "checkpoint_every": 0})


def window_kls(teacher_model, candidate, ids, kv_dtype: str | None = None) -> np.ndarray:
    """Mean KL(teacher || candidate) per held-out window (equal tokens per window); `kv_dtype`: the candidate
    reads its cache rounded as the engine stores it in that format (heal.quant_aware), the teacher its exact one."""
    from kvconvert.heal.evaluate import window_metrics
    from kvconvert.quant.capture import load_hf_model

    model = load_hf_model(candidate).to(next(teacher_model.parameters()).device)
    if kv_dtype is not None:
        from kvconvert.heal.quant_aware import attach_cache_rounding
        from kvconvert.kvmath import kv_shape

        attach_cache_rounding(model, kv_shape(model.config.to_dict()), kv_dtype)
    return np.array([window_metrics(teacher_model, {"c": model}, ids[i:i + 1])["c"]["kl_mean"]
                     for i in range(ids.shape[0])])


def plan_heal(student, teacher, stages, out, opts, overwrite: bool = False, progress: bool = True,
              echo=print) -> dict:
    """Measure opts.budgets short distillations of `student` (after the recipe's layer-wise stage, run
    once), fit KL against tokens, and write heal_plan.json and heal_plan.png to `out`: the tokens and
    hours to reach opts.kl_target on opts.devices devices."""
    import json
    import shutil
    import time
    from pathlib import Path

    from kvconvert.checkpoint import atomic_write_text, check_output_path, load_tokenizer, read_config
    from kvconvert.data import eval_windows
    from kvconvert.device import resolve_device
    from kvconvert.errors import KVConvertError
    from kvconvert.heal.api import check_stages_for, heal_stages
    from kvconvert.heal.memory import MEASURED_SPEEDS, measured_speed
    from kvconvert.quant.capture import load_hf_model
    from kvconvert.sources import resolve_source

    if stages.distill is None:
        raise KVConvertError("heal --plan measures the recipe's heal_distill block, and this recipe has none")
    t0 = time.time()
    budgets = distinct_run_budgets(stages.distill, opts.budgets)
    student, teacher, out = resolve_source(student), resolve_source(teacher), Path(out)
    check_output_path(out, overwrite, sources=(student, teacher))
    check_eval_window(read_config(student), opts.eval_window)
    check_stages_for(read_config(student), read_config(teacher), stages)  # before the layer-wise stage runs
    work = out.parent / f".{out.name}.heal-plan"
    ids = eval_windows(load_tokenizer(teacher), opts.eval_windows, opts.eval_window, opts.eval_data)
    device = resolve_device(stages.distill.device)
    start = student
    if stages.layerwise is not None:  # once: every budget distils from its output
        start = work / "layerwise"
        echo(f"heal --plan: the recipe's layer-wise stage first ({stages.layerwise.tokens} tokens)")
        heal_stages(student, teacher, _Stages(stages.layerwise, None), start, overwrite=True, progress=progress)
    teacher_model = load_hf_model(teacher).to(device)
    kv_dtype = stages.distill.kv_dtype
    before = window_kls(teacher_model, start, ids, kv_dtype)
    echo(f"heal --plan: KL(source || model) on {ids.shape[0]} x {ids.shape[1]} tokens of {opts.eval_data}; "
         f"before distillation {before.mean():.4f}")
    points = []
    for tokens in budgets:
        stage = budget_stage(stages.distill, tokens)
        run = work / f"distill-{tokens}"
        report = heal_stages(start, teacher, _Stages(None, stage), run, overwrite=True, progress=progress)
        kls = window_kls(teacher_model, run, ids, kv_dtype)
        d = report["stages"]["heal_distill"]
        points.append({"tokens": int(d["tokens"]), "kl": float(kls.mean()),
                       "kl_se": float(kls.std(ddof=1) / math.sqrt(len(kls))), "tokens_per_s": d["tokens_per_s"],
                       "seconds": report["seconds"]})
        echo(f"  {points[-1]['tokens']:>9,} tokens: KL {points[-1]['kl']:.4f} ± {points[-1]['kl_se']:.4f} "
             f"({d['tokens_per_s']:.0f} tokens/s on {device.type}, {report['seconds']:.0f} s)")
    del teacher_model
    try:
        fit = fit_power_law([p["tokens"] for p in points], [p["kl"] for p in points], [p["kl_se"] for p in points])
    except ValueError as exc:  # a KL of 0: the student reads exactly what the teacher does (nothing to heal)
        kls = ", ".join(f"{p['kl']:.3g}" for p in points)
        raise KVConvertError(f"heal --plan: {exc} (measured KL {kls}); a KL of 0 means the student already matches "
                             "the teacher exactly: nothing to plan") from None
    reach = fit.interval(opts.kl_target)
    if (measured := reached_at(float(before.mean()), points, opts.kl_target)) is not None:
        # a fit cannot extrapolate back to a target the runs already passed (it is flat there, or below it)
        reach = {"p16": measured, "p50": measured, "p84": measured, "reachable": 1.0, "already_reached": True}
    speed = float(np.median([p["tokens_per_s"] for p in points]))
    speeds = [{"device": f"{device.type} (measured here)", "tokens_per_s": speed, "source": "the short runs"}]
    teacher_cfg = read_config(teacher)
    for name in dict.fromkeys(row[1] for row in MEASURED_SPEEDS if row[0] == "cuda"):
        if (known := measured_speed(teacher_cfg, "cuda", name)) is not None:
            speeds.append({"device": name, "tokens_per_s": known[0], "source": known[1]})
    for s in speeds:
        s["hours"] = {k: hours(reach[k], s["tokens_per_s"], opts.devices) for k in ("p16", "p50", "p84")}
    plan = {"student": str(student), "teacher": str(teacher), "recipe": stages.to_dict(), "options": opts.model_dump(),
            "eval": {"data": opts.eval_data, "windows": int(ids.shape[0]), "window": int(ids.shape[1]),
                     "kl_before": float(before.mean())},
            "points": points, "fit": {"a": fit.a, "b": fit.b, "c": fit.c, "se": fit.errors(), "dof": fit.dof},
            "target": {"kl": opts.kl_target, "tokens": reach, "devices": opts.devices, "speeds": speeds},
            "seconds": round(time.time() - t0, 1)}
    for line in plan_summary(plan):
        echo(line)
    out.mkdir(parents=True, exist_ok=True)
    title = f"tokens to KL {opts.kl_target:g}: {student.name}"
    plot_fit(points, fit, opts.kl_target, reach, work / "heal_plan.png", title)
    shutil.move(str(work / "heal_plan.png"), out / "heal_plan.png")
    atomic_write_text(out / "heal_plan.json", json.dumps(finite_json(plan), indent=1, default=float,
                                                         allow_nan=False) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return plan


def reached_at(kl_before: float, points: list[dict], target: float) -> int | None:
    """The fewest tokens at which a measured KL is already at or below `target` (0: before distillation), or None."""
    if kl_before <= target:
        return 0
    return min((p["tokens"] for p in points if p["kl"] <= target), default=None)


def finite_json(value):
    """`value` with every non-finite float (a target never reached: inf tokens, inf hours) as None: JSON has no
    Infinity, and strict readers refuse it."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def _tokens_text(t: float) -> str:
    if not math.isfinite(t):
        return "never"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if t >= size:
            return f"{t / size:.3g}{unit}"
    return f"{t:.0f}"


def plan_summary(plan: dict) -> list[str]:
    """The plan's prediction in a few lines (what `kvconvert heal --plan` prints)."""
    fit, target = plan["fit"], plan["target"]
    se = fit["se"]
    err = (lambda k: f" ± {se[k]:.3g}") if se else (lambda k: "")
    reach = target["tokens"]
    lines = [f"fit: KL(T) = a T^-b + c, a = {fit['a']:.4g}{err('a')}, b = {fit['b']:.3f}{err('b')}, "
             f"c = {fit['c']:.4f}{err('c')} ({len(plan['points'])} budgets)"]
    if reach.get("already_reached"):
        where = "before distillation" if reach["p50"] == 0 else f"at {_tokens_text(reach['p50'])} tokens"
        return lines + [f"to KL {target['kl']:g}: already reached (measured {where}); no further distillation "
                        "is needed for this target"]
    lines += [f"to KL {target['kl']:g}: {_tokens_text(reach['p50'])} tokens (16-84%: {_tokens_text(reach['p16'])} - "
             f"{_tokens_text(reach['p84'])}; {100 * reach['reachable']:.0f}% of the fit's draws reach it)"]
    for s in target["speeds"]:
        h = s["hours"]["p50"]
        lines.append(f"  on {target['devices']} x {s['device']} at {s['tokens_per_s']:,.0f} tokens/s each: "
                     f"{h['wall_h']:.3g} h wall, {h['device_h']:.3g} device-hours (16-84%: "
                     f"{s['hours']['p16']['device_h']:.3g} - {s['hours']['p84']['device_h']:.3g})")
    return lines
