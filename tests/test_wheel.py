"""The built wheel carries everything the CLI reads at run time, and an installed copy finds it
with the checkout nowhere on its path (kvconvert/resources.py).

The checkout's package sources (pyproject's package-dir folders, as git lists them: what a clean
clone has) are copied to a temporary folder, built with `pip wheel --no-deps --no-build-isolation`,
and the wheel installed with `pip install --no-deps --target SITE`. The installed copy then runs
with `python -S -P`, PYTHONPATH = SITE + this interpreter's site-packages for the dependencies, from
another folder: -S skips the .pth files, so the editable install's finder (which maps kvconvert.*
onto the checkout) never loads, and -P keeps the working folder off sys.path. Every kvconvert file
the run touches must then lie under SITE, which the test checks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
RECIPE = "smollm2-135m-25pct"  # a built-in recipe, resolved by name

pytestmark = pytest.mark.slow  # about 20-25 s on 2 loaded cores (the build, then three CLI runs); CI runs it


def git_files(*folders: str) -> list[str]:
    """Files git has (tracked, or new and not ignored) under `folders`: what a clean clone builds from."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *folders],
                         cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def copy_sources(dest: Path) -> None:
    """pyproject.toml, the readme and every package-dir folder, as git lists them."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    folders = sorted(set(setuptools["package-dir"].values()))
    for rel in ["pyproject.toml", PYPROJECT["project"]["readme"], *git_files(*folders)]:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)


def pip(*args: str, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-index", "--quiet",
                           "--disable-pip-version-check"], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory):
    """(the wheel, the folder it is installed into)."""
    tmp = tmp_path_factory.mktemp("wheel")
    copy_sources(tmp / "src")
    pip("wheel", "--no-build-isolation", "--wheel-dir", str(tmp / "dist"), str(tmp / "src"), cwd=tmp)
    (wheel,) = (tmp / "dist").glob("kvconvert-*.whl")
    pip("install", "--target", str(tmp / "site"), str(wheel), cwd=tmp)
    return wheel, tmp / "site"


def installed_python(site: Path, cwd: Path):
    """A runner of `python -S -P ARGS` that imports kvconvert only from `site` (see the module docstring)."""
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "KVCONVERT_LONGBENCH_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *deps])

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-S", "-P", *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=300)
    return run


def console_script(site: Path) -> str:
    """`python -c` code that runs the wheel's `kvconvert` entry point (its dist-info's entry_points.txt)."""
    (entry_points,) = site.glob("kvconvert-*.dist-info/entry_points.txt")
    line = next(x for x in entry_points.read_text().splitlines() if x.replace(" ", "").startswith("kvconvert="))
    module, func = line.split("=", 1)[1].strip().split(":")
    return f"import sys; sys.argv[0] = 'kvconvert'; from {module} import {func}; sys.exit({func}())"


def write_report(folder: Path, longbench: bool) -> Path:
    """A report.json of the quick suite in validate's format (kvconvert.eval.report.build_report):
    4 essay windows and 2 samples of each LongBench task, candidate equal to the source; without
    `longbench`, LongBench is skipped for missing data, as validate records it."""
    from kvconvert.eval.metrics import LONGBENCH_TASKS
    from kvconvert.eval.report import build_report
    from kvconvert.eval.suites import SUITE_VERSION, SUITES

    spec = SUITES["quick"]
    samples = {"perplexity": [{"id": f"w{i}", "n_tokens": 511, "source_nll": 1500.0 + i, "candidate_nll": 1500.0 + i,
                               "kl": 0.0} for i in range(4)]}
    skipped = {"ruler": "the quick suite does not run RULER"}
    if longbench:
        samples.update({f"longbench/{task}": [{"id": f"{task}-{i}", "source": {"score": 0.25 * i, "answer_nll": 1.0 + i},
                                               "candidate": {"score": 0.25 * i, "answer_nll": 1.0 + i}}
                                              for i in range(2)]
                        for task in LONGBENCH_TASKS})
    else:
        skipped["longbench"] = "LongBench-mini data not found at /nowhere; pass --longbench-dir DIR"
    header = {"suite": {"name": spec.name, "version": SUITE_VERSION, "spec": spec.as_dict()}, "skipped": skipped}
    path = folder / ("report.json" if longbench else "report-no-longbench.json")
    path.write_text(json.dumps(build_report(header, samples)))
    return path


def test_wheel_holds_the_runtime_files(wheel_install):
    wheel, _ = wheel_install
    names = set(zipfile.ZipFile(wheel).namelist())
    recipes = [f for f in git_files("recipes") if not f.endswith(".py")]  # every recipe, policy, accelerate config
    assert recipes and not [f for f in recipes if f"kvconvert/{f}" not in names]
    assert {"kvconvert/recipes/gates/default.yaml", f"kvconvert/recipes/{RECIPE}.yaml"} <= names
    data = git_files("kvconvert/eval/longbench-mini")
    assert len([f for f in data if f.endswith(".jsonl.gz")]) == 16
    assert {"kvconvert/eval/longbench-mini/README.md", "kvconvert/eval/longbench-mini/LICENSE-LongBench"} <= names
    assert not [f for f in data if f not in names]


def test_installed_wheel_runs_from_another_folder(wheel_install, tmp_path):
    """gate --policy default on a report, a built-in recipe by name, LongBench-mini's 187 samples:
    all from the installed files, none from the checkout."""
    _, site = wheel_install
    run = installed_python(site, cwd=tmp_path)
    kvconvert = console_script(site)

    probe = run("-c", f"""if True:
        import json, sys
        import kvconvert
        from kvconvert import resources as R
        from kvconvert.eval import longbench as LB
        from kvconvert.recipe import load_recipe
        rows = LB.load_longbench(LB.default_longbench_dir())
        print(json.dumps({{"files": [kvconvert.__file__, str(R.find_policy("default")), str(R.find_recipe("{RECIPE}")),
                                    str(LB.default_longbench_dir())] + [m.__file__ for m in list(sys.modules.values())
                                    if m.__name__.startswith("kvconvert") and getattr(m, "__file__", None)],
                          "finders": [repr(f) for f in sys.meta_path], "recipe": load_recipe("{RECIPE}").name,
                          "tasks": len(rows), "samples": sum(len(r) for r in rows.values())}}))""")
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    outside = [f for f in found["files"] if not Path(f).resolve().is_relative_to(site.resolve())]
    assert not outside, f"read beside the install: {outside}"
    assert not [f for f in found["finders"] if "editable" in f.lower()]
    assert (found["recipe"], found["tasks"], found["samples"]) == (RECIPE, 16, 187)

    gate = run("-c", kvconvert, "gate", "--report", str(write_report(tmp_path, longbench=True)), "--policy", "default")
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert "gate passed" in gate.stdout and "answer_nll_increase" in gate.stdout

    # the default policy fails a report whose suite runs LongBench but skipped it: the answer likelihoods it
    # gates were not measured
    skipped = run("-c", kvconvert, "gate", "--report", str(write_report(tmp_path, longbench=False)), "--policy",
                  "default")
    assert skipped.returncode == 1, skipped.stdout + skipped.stderr
    assert "gate FAILED: answer_nll_increase" in skipped.stdout

    # the recipe is found by name and read (its source, smollm2-135m, conflicts with --src) before any work
    pipeline = run("-c", kvconvert, "pipeline", "--recipe", RECIPE, "--src", "other-model", "--out", "o")
    assert pipeline.returncode == 2, pipeline.stdout + pipeline.stderr
    assert "the recipe's source is smollm2-135m" in pipeline.stderr
    unknown = run("-c", kvconvert, "gate", "--report", "report.json", "--policy", "defualt")
    assert unknown.returncode == 2 and "not a built-in policy (default, smoke, strict)" in unknown.stderr
    assert not (tmp_path / "o").exists()


def test_installed_wheel_has_the_llamacpp_engine(wheel_install, tmp_path):
    """The llama.cpp worker (started as `python -P -m kvconvert.engines.llamacpp_worker`) and the GGUF export
    come from the installed files: the worker answers a bad command line with its usage and exit 2."""
    _, site = wheel_install
    run = installed_python(site, cwd=tmp_path)
    done = run("-m", "kvconvert.engines.llamacpp_worker")
    assert done.returncode == 2 and "usage: python -m kvconvert.engines.llamacpp_worker" in done.stderr, done.stderr
    probe = run("-c", "import kvconvert.engines.llamacpp as e, kvconvert.engines.llamacpp_worker as w, "
                      "kvconvert.checkpoint.gguf_export as g, kvconvert.token_stats as t; "
                      "print('\\n'.join(m.__file__ for m in (e, w, g, t)))")
    assert probe.returncode == 0, probe.stderr
    files = probe.stdout.split()
    assert len(files) == 4 and all(Path(f).resolve().is_relative_to(site.resolve()) for f in files), files
