"""`kvconvert pipeline`: recipe blocks and flags become the stages' options models; each stage's
printed command line rebuilds exactly those options; a pipeline interrupted after its first
stage resumes from that stage's output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from kvconvert.commands.calibrate import calibrate_cmd
from kvconvert.commands.heal import heal_cmd
from kvconvert.commands.main import cli
from kvconvert.commands.mla import mla_cmd
from kvconvert.commands.validate import validate_cmd
from kvconvert.data import pydoc_corpus
from kvconvert.errors import KVConvertError
from kvconvert.mla.options import MLAOptions
from kvconvert.pipeline import _from_flags, _from_plan, recipe_stages
from kvconvert.recipe import load_recipe, parse_recipe
from kvconvert.stage_options import build_options

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
COMMANDS = {"convert": mla_cmd, "heal": heal_cmd, "calibrate": calibrate_cmd, "validate": validate_cmd}

EVERY_CONVERT_KEY = {"rank": 48, "rope_dim": 16, "q_rank": 96, "calib_data": "essays", "calib_tokens": 1024,
                     "calib_window": 256, "dtype": "fp32", "key_weight": 0.5, "rho": 1e-3, "stream": "source",
                     "target": "any", "refit_o_proj": False}
EVERY_CALIBRATE_KEY = {"kv_dtype": "nvfp4", "observer": "percentile", "granularity": "head", "percentile": 99.9,
                       "rotate": True, "key_phase": False, "value_rotation": False, "rotation_block": 32,
                       "key_strength": 0.5, "search_tokens": 0, "calib_data": "essays", "calib_tokens": 2048,
                       "format": "both"}
EVERY_VALIDATE_KEY = {"suite": "smoke", "engine": "transformers", "kv_dtype": "fp8", "source_kv_dtype": "fp32",
                      "kv_scales": "dynamic", "dtype": "fp32", "longbench_dir": Path("/data/lb")}


def _params(stage) -> dict:
    """The parameters the real click command receives for the stage's printed command (parsed, not run)."""
    command = COMMANDS[stage.name]
    return command.make_context(command.name, list(stage.argv[1:])).params


def _printed_options(stage):
    """The options model the stage's printed command line builds."""
    return build_options(type(stage.options), _params(stage))


def _stages(blocks: dict, tmp_path: Path, src: str = "smollm2-135m", **kwargs):
    """The pipeline's stages for a recipe of `blocks` (as if read from tmp_path/r.yaml), into tmp_path."""
    return recipe_stages(parse_recipe(blocks, "r.yaml"), tmp_path / "r.yaml", src, tmp_path, **kwargs)


def test_every_key_reaches_the_stages_and_their_printed_commands(tmp_path):
    stages = _stages({"convert": EVERY_CONVERT_KEY, "calibrate": EVERY_CALIBRATE_KEY,
                      "validate": {**EVERY_VALIDATE_KEY, "gate": "smoke"}}, tmp_path)
    assert [s.name for s in stages] == ["convert", "calibrate", "validate", "gate"]
    for stage, keys in zip(stages, (EVERY_CONVERT_KEY, EVERY_CALIBRATE_KEY, EVERY_VALIDATE_KEY)):
        assert stage.options.model_dump(include=set(keys)) == pytest.approx(keys), stage.name
        assert _printed_options(stage) == stage.options, stage.name
    (conv, cal, val), gate = [_params(s) for s in stages[:3]], stages[3].argv
    assert conv["heal"] == "none" and conv["out_dir"] == stages[0].out == tmp_path / "mla"
    assert cal["src"] == str(tmp_path / "mla") and cal["out"] == tmp_path / "mla-nvfp4"
    assert (val["source"], val["candidate"]) == ("smollm2-135m", str(cal["out"]))
    assert gate[-1] == str(ROOT / "recipes" / "gates" / "smoke.yaml")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_make_valid_commands(path, tmp_path):
    recipe = load_recipe(path)
    stages = recipe_stages(recipe, path, recipe.source or "smollm2-135m", tmp_path)
    assert Path(stages[-1].argv[-1]).is_file()
    if stages[0].name == "heal":  # no conversion: the source healed for its cache
        assert _params(stages[0])["recipe"] == str(path) and recipe.stage("convert") is None
    else:
        assert _params(stages[0])["heal"] == (str(path) if recipe.heals() else "none")
    for stage in stages[:-1]:
        if stage.options is not None:  # heal and export: their printed commands carry no options model
            assert _printed_options(stage) == stage.options, stage.name


def test_unset_keys_take_the_stages_defaults(tmp_path):
    convert, calibrate, validate, _ = _stages({"convert": {"rank": 64}, "calibrate": {}}, tmp_path)
    assert convert.options == MLAOptions(rank=64)
    assert convert.argv[1:4] == ["--src", "smollm2-135m", "--rank"] and "--key-weight" not in convert.argv
    assert calibrate.options.kv_dtype == validate.options.kv_dtype == "fp8"  # validated in the calibrated format
    assert "--kv-dtype" in calibrate.argv and validate.options.suite == "quick"


@pytest.mark.parametrize("blocks, first, candidate, kv_dtype", [
    ({"convert": {"rank": 64}}, "convert", "mla", "auto"),  # no calibrate block: the unquantized model
    ({"calibrate": {"kv_dtype": "nvfp4"}}, "calibrate", "source-nvfp4", "nvfp4"),  # "don't convert, just quantize"
])
def test_a_recipe_with_one_build_block(blocks, first, candidate, kv_dtype, tmp_path):
    stages = _stages(blocks, tmp_path)
    assert [s.name for s in stages] == [first, "validate", "gate"] and _params(stages[0])["src"] == "smollm2-135m"
    assert (_params(stages[1])["candidate"], stages[1].options.kv_dtype) == (str(tmp_path / candidate), kv_dtype)


def test_recipe_needs_a_convert_or_calibrate_block(tmp_path):
    with pytest.raises(KVConvertError, match="needs a `convert` or a `calibrate` block"):
        _stages({"validate": {}}, tmp_path)
    with pytest.raises(KVConvertError, match="heal_layerwise fits an MLA conversion's layers"):
        _stages({"heal_layerwise": {}, "calibrate": {}}, tmp_path)
    with pytest.raises(KVConvertError, match="heal_distill without kv_dtype and without a `convert` block"):
        _stages({"heal_distill": {}, "calibrate": {"kv_dtype": "q5_0/iq4_nl"}}, tmp_path)


def test_a_recipe_without_convert_heals_the_source_for_its_cache(tmp_path):
    """heal_distill with kv_dtype and no conversion: the source distilled with its cache rounded, then calibrated,
    exported and validated against the source."""
    stages = _stages({"heal_distill": {"kv_dtype": "q5_0/iq4_nl", "lr": 1e-4},
                      "calibrate": {"kv_dtype": "q5_0/iq4_nl"}}, tmp_path)
    assert [s.name for s in stages] == ["heal", "calibrate", "export", "validate", "gate"]
    heal, calibrate = stages[0], stages[1]
    assert heal.out == tmp_path / "healed" and heal.source == "smollm2-135m"
    assert {k: str(v) for k, v in _params(heal).items() if k in ("student", "teacher", "recipe", "out")} == {
        "student": "smollm2-135m", "teacher": "smollm2-135m", "recipe": str(tmp_path / "r.yaml"),
        "out": str(tmp_path / "healed")}
    assert heal.provenance()["heal"]["heal_distill"]["lr"] == 1e-4  # a changed heal block rebuilds it
    assert "device" not in heal.provenance()["heal"]["heal_distill"] and "calibrate" not in heal.provenance()["heal"]
    assert _params(calibrate)["src"] == str(tmp_path / "healed")
    assert calibrate.out == tmp_path / "healed-q5_0+iq4_nl"
    assert _params(stages[3])["source"] == "smollm2-135m"
    assert _params(stages[3])["candidate"] == str(tmp_path / "healed-q5_0+iq4_nl")


RECIPE_25 = str(ROOT / "recipes" / "smollm2-135m-25pct.yaml")


@pytest.mark.parametrize("args, message", [
    (["--no-mla", "--rank", "256"], "--rank: belong to the MLA conversion"),
    (["--no-mla", "--kv-dtype", "bf16"], "nothing to build"),
    (["--recipe", RECIPE_25, "--rank", "32"], "--rank: set by the recipe"),
    (["--recipe", RECIPE_25, "--src", "other"], "the recipe's source is smollm2-135m"),
    *[(["--kv-budget", "50%", *flags], "--kv-budget lets `kvconvert plan` choose these")
      for flags in (["--rank", "64"], ["--no-mla"], ["--kv-dtype", "nvfp4"], ["--recipe", RECIPE_25])],
    (["--kv-budget", "150%"], "--kv-budget '150%'"),
    (["--no-mla", "--kv-dtypes", "q4_0"], "--kv-dtypes: the formats a plan considers: give it with --kv-budget"),
    (["--kv-budget", "30%", "--kv-dtypes", "q4_0,q9"], "--kv-dtypes: q9: not a KV format plan measures"),
])
def test_conflicting_flags_are_refused_before_any_work(args, message, tmp_path):
    result = CliRunner().invoke(cli, ["pipeline", *args, "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, KVConvertError) and message in str(result.exception)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, message", [
    (["--calib-tokens", "100"], "--calib-tokens 100 is less than one window (512)"),  # the stage's rule, no other limit
    (["--rope-dim", "0"], "--rope-dim: Input should be greater than 0"),
    (["--device", "gpu0"], "--device: String should match pattern"),
])
def test_pipeline_flags_are_the_stage_fields_with_their_limits(args, message, tmp_path):
    """--calib-tokens, --rank, --device... are generated from PipelineOptions, whose fields are the stages' own."""
    result = CliRunner().invoke(cli, ["pipeline", "--target", "any", "--rank", "64", "--kv-dtype", "bf16", *args,
                                      "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, KVConvertError) and message in str(result.exception), result.output
    assert not (tmp_path / "o").exists()


def test_flag_pipeline_builds_the_same_stages_as_a_recipe(tmp_path):
    stages = _from_flags("smollm2-135m", 160, 32, "any", "layerwise", 2048, "fp8", "smoke", "smoke", tmp_path)
    from_recipe = _stages({"convert": {"rank": 160, "rope_dim": 32, "target": "any", "calib_tokens": 2048},
                           "heal_layerwise": {}, "calibrate": {"kv_dtype": "fp8", "calib_tokens": 2048},
                           "validate": {"suite": "smoke", "gate": "smoke"}}, tmp_path)
    assert [(s.name, s.options, s.out) for s in stages] == [(s.name, s.options, s.out) for s in from_recipe]
    assert _params(stages[0])["heal"] == "layerwise"
    assert [s.name for s in _from_flags("x", 64, 32, "any", "none", None, "bf16", "quick", "default", tmp_path)] == \
        ["convert", "validate", "gate"]
    with pytest.raises(KVConvertError, match="--suite: Input should be"):
        _from_flags("x", 64, 32, "any", "none", None, "bf16", "quik", "default", tmp_path)


def test_flag_pipeline_refuses_a_heal_for_another_cache_format(tmp_path):
    """--heal RECIPE (quantization-aware for nvfp4) with --kv-dtype fp8: two sources the Recipe cannot check."""
    heal = tmp_path / "qat.yaml"
    heal.write_text("heal_distill:\n  kv_dtype: nvfp4\n")
    with pytest.raises(KVConvertError, match="qat.yaml: heal_distill.kv_dtype is nvfp4 but calibrate.kv_dtype is fp8"):
        _from_flags("smollm2-135m", 160, 32, "any", str(heal), None, "fp8", "quick", "default", tmp_path)
    assert [s.name for s in _from_flags("smollm2-135m", 160, 32, "any", str(heal), None, "nvfp4", "quick",
                                        "default", tmp_path)] == ["convert", "calibrate", "validate", "gate"]


def test_device_reaches_every_stage_and_its_printed_command(tmp_path):
    blocks = {"convert": {"rank": 64, "rope_dim": 32, "target": "any", "device": "cpu"},
              "calibrate": {"kv_dtype": "fp8"}}
    for stages in (_from_flags("smollm2-135m", 64, 32, "any", "none", None, "fp8", "quick", "default", tmp_path,
                               device="cuda:1"), _stages(blocks, tmp_path, device="cuda:1")):
        for stage in stages[:3]:
            assert stage.options.device == "cuda:1", stage.name
            assert _printed_options(stage) == stage.options, stage.name
    kept = _stages(blocks, tmp_path)  # no --device: the recipe's own
    assert [s.options.device for s in kept[:3]] == ["cpu", "auto", "auto"]
    with pytest.raises(KVConvertError, match="device"):
        _stages(blocks, tmp_path, device="gpu0")


def test_kv_budget_runs_the_recipe_of_an_existing_plan(tmp_path, monkeypatch):
    """A plan already measured for this source's weights and budget with plan's defaults (plan.json) is reused,
    whatever device it ran on: its recipe's stages run. A plan made with other options (another target) is refused
    unless --overwrite, which plans anew with the pipeline's --device."""
    import kvconvert.plan as plan
    from kvconvert.checkpoint.fingerprint import checkpoint_fingerprint
    from kvconvert.pipeline import PipelineOptions
    from kvconvert.sources import resolve_source

    out = tmp_path / "o"
    (out / "plan").mkdir(parents=True)
    recipe = {"source": "smollm2-135m", "calibrate": {"kv_dtype": "fp8"}}
    (out / "plan" / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    made_on_a_gpu = plan.PlanOptions(target="vllm", device="cuda")
    (out / "plan" / "plan.json").write_text(json.dumps({
        "format": plan.PLAN_FORMAT, "budget": 0.5, "options": made_on_a_gpu.model_dump(), "recipe": recipe,
        "source_fingerprint": checkpoint_fingerprint(resolve_source("smollm2-135m"))}))
    planned = []
    monkeypatch.setattr(plan, "run_plan", lambda src, budget, opts, out, echo, overwrite, rebuild: planned.append(opts))

    def from_plan(target, device=None, overwrite=False):
        given = frozenset({"kv_budget", "target"} | ({"device"} if device else set()))
        opts = PipelineOptions.model_construct(kv_budget="50%", target=target, device=device)  # gpu0: the plan's check
        return _from_plan("smollm2-135m", opts, out, overwrite, given)

    src, stages = from_plan("vllm")
    assert not planned
    assert [s.name for s in stages] == ["calibrate", "validate", "gate"]
    assert stages[0].options.kv_dtype == "fp8" and stages[0].out == out / "source-fp8"
    with pytest.raises(KVConvertError, match=r"made with other options \(target \"vllm\" -> \"any\"\); pass "
                                             r"--overwrite to plan again"):
        from_plan("any", "cpu")
    assert not planned
    from_plan("any", "cpu", overwrite=True)
    assert planned == [plan.PlanOptions(target="any", device="cpu")]
    with pytest.raises(KVConvertError, match="--device"):
        from_plan("vllm", "gpu0")


def test_pipeline_json_records_the_plan_command_that_ran(tmp_path, monkeypatch):
    """pipeline --kv-budget with --target, --calib-tokens and --kv-dtypes: pipeline.json's plan stage is the whole
    `kvconvert plan` command (--src and every option the plan ran with), which plan's own parser reads back into
    the same options."""
    import shlex

    import kvconvert.pipeline as pipeline
    import kvconvert.plan as plan
    from kvconvert.checkpoint.fingerprint import checkpoint_fingerprint
    from kvconvert.commands.plan import plan_cmd
    from kvconvert.pipeline import PipelineOptions, run_pipeline
    from kvconvert.sources import resolve_source

    out = tmp_path / "o"
    (out / "plan").mkdir(parents=True)
    recipe = {"source": "smollm2-135m", "calibrate": {"kv_dtype": "fp8"}}
    (out / "plan" / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    planned = plan.PlanOptions(target="vllm", calib_tokens=1024, kv_calib_tokens=1024, kv_dtypes=("fp8",))
    (out / "plan" / "plan.json").write_text(json.dumps({
        "format": plan.PLAN_FORMAT, "budget": 0.55, "options": planned.model_dump(), "recipe": recipe,
        "source_fingerprint": checkpoint_fingerprint(resolve_source("smollm2-135m"))}))
    monkeypatch.setattr(pipeline, "run_stages", lambda stages, overwrite, echo: [])  # the plan's record only
    opts = PipelineOptions(kv_budget="55%", target="vllm", calib_tokens=1024, kv_dtypes=("fp8",))
    run_pipeline("smollm2-135m", None, opts, out, given=frozenset({"kv_budget", "target", "calib_tokens", "kv_dtypes"}),
                 echo=lambda *a: None)
    command = json.loads((out / "pipeline.json").read_text())["stages"][0]["command"]
    argv = shlex.split(command)
    assert argv[:6] == ["kvconvert", "plan", "--src", "smollm2-135m", "--kv-budget", "55%"]
    for flag in ("--target vllm", "--calib-tokens 1024", "--kv-calib-tokens 1024", "--kv-dtypes fp8",
                 f"--out {out / 'plan'}"):
        assert flag in command, command
    params = plan_cmd.make_context("plan", argv[2:]).params
    assert build_options(plan.PlanOptions, params) == planned


# ------------------------------------------------------------------ a real run, interrupted and resumed

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "tests" / "quant"))
    from quant_cases import make_llama

    return make_llama(tmp_path_factory.mktemp("src") / "llama")


def test_interrupted_pipeline_resumes_from_the_finished_stage(tiny_llama, tmp_path):
    """The calibrate stage fails (its data file is missing) after the conversion was written; once the
    file exists, the same command reuses the conversion untouched and finishes the other stages."""
    convert_data, calibrate_data = tmp_path / "convert.txt", tmp_path / "calibrate.txt"
    convert_data.write_text(pydoc_corpus()[:40_000])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "source": str(tiny_llama),
        "convert": {"rank": 16, "rope_dim": 8, "target": "any", "calib_data": str(convert_data), "calib_tokens": 512,
                    "calib_window": 128, "dtype": "fp32"},
        "calibrate": {"kv_dtype": "fp8", "observer": "amax", "calib_data": str(calibrate_data), "calib_tokens": 256,
                      "window_len": 64, "batch_size": 2},
        "validate": {"suite": "smoke", "engine": "transformers", "gate": "smoke"}}))
    out, mla = tmp_path / "out", tmp_path / "out" / "mla"
    args = ["pipeline", "--recipe", str(recipe), "--out", str(out)]
    interrupted = CliRunner().invoke(cli, args)
    assert isinstance(interrupted.exception, KVConvertError) and str(calibrate_data) in str(interrupted.exception)
    assert "pipeline stage 'calibrate' failed; rerun it alone: kvconvert calibrate" in interrupted.output
    assert (mla / "manifest.json").is_file() and not (out / "mla-fp8").exists()
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in mla.iterdir()}

    calibrate_data.write_text(pydoc_corpus()[40_000:80_000])
    resumed = CliRunner().invoke(cli, args)
    assert resumed.exit_code == 0, resumed.output
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in mla.iterdir()} == before
    assert f"== convert: reusing {mla}" in resumed.output
    log = json.loads((out / "pipeline.json").read_text())["stages"]
    assert [(s["stage"], s.get("reused", False)) for s in log] == \
        [("convert", True), ("calibrate", False), ("validate", False), ("gate", False)]
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["candidate"]["path"] == str(out / "mla-fp8") and report["candidate"]["kv_dtype"] == "fp8"
    assert (out / "mla-fp8" / "manifest.json").is_file()


def test_a_source_healed_for_its_cache_is_calibrated_validated_and_reused(tiny_llama, tmp_path):
    """No convert block: the source distilled with its FP8 cache rounded (heal), that model calibrated and
    validated against the unhealed source; a second run reuses the healed model."""
    from safetensors.torch import load_file

    data = tmp_path / "text.txt"
    data.write_text(pydoc_corpus()[:40_000])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "source": str(tiny_llama),
        "heal_distill": {"data": str(data), "tokens": 4 * 64, "seq_len": 64, "batch_size": 1, "lr": 0.01,
                         "warmup_steps": 1, "kv_dtype": "fp8"},
        "calibrate": {"kv_dtype": "fp8", "observer": "amax", "calib_data": str(data), "calib_tokens": 256,
                      "window_len": 64},
        "validate": {"suite": "smoke", "engine": "transformers", "gate": "smoke"}}))
    out = tmp_path / "out"
    args = ["pipeline", "--recipe", str(recipe), "--out", str(out)]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    log = json.loads((out / "pipeline.json").read_text())["stages"]
    assert [s["stage"] for s in log] == ["heal", "calibrate", "validate", "gate"]
    healed = {k: v for f in (out / "healed").glob("*.safetensors") for k, v in load_file(f).items()}
    source = {k: v for f in tiny_llama.glob("*.safetensors") for k, v in load_file(f).items()}
    assert healed.keys() == source.keys()
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    assert not torch.equal(healed[k_proj], source[k_proj])
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["candidate"]["path"] == str(out / "healed-fp8") and report["source"]["path"] == str(tiny_llama)

    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 0, again.output
    assert f"== heal: reusing {out / 'healed'}" in again.output


def test_the_plans_build_stands_for_the_stage_only_when_its_record_matches(tiny_llama, tmp_path):
    """`pipeline --kv-budget`: the calibrate stage uses the checkpoint the plan built (hard links, no copy), even
    with --overwrite (the plan rebuilt it in this run), when its provenance says it was built from the stage's
    source with the stage's options; a build with other options is not used: the stage runs."""
    from kvconvert.checkpoint.provenance import record_artifact, stage_record
    from kvconvert.pipeline import run_stages
    from kvconvert.quant.options import CalibrateOptions
    from kvconvert.quant.run import CalibrateJob, run_calibrate

    data = tmp_path / "calib.txt"
    data.write_text(pydoc_corpus()[:40_000])
    block = {"kv_dtype": "fp8", "observer": "amax", "calib_data": str(data), "calib_tokens": 256, "window_len": 64}
    built = tmp_path / "plan" / "artifacts" / "source-fp8"
    opts = CalibrateOptions(**block, device="cpu")
    run_calibrate(CalibrateJob(src=str(tiny_llama), options=opts, out=built), echo=lambda m: None)
    record_artifact(built, tiny_llama, stage_record("calibrate", opts))
    out = tmp_path / "out"
    stage = _stages({"calibrate": block}, out, src=str(tiny_llama))[0]
    stage.prebuilt = built
    log = run_stages([stage], overwrite=True)
    assert log[0]["reused"] and log[0]["from_plan"] == str(built)
    weights = next(built.glob("*.safetensors"))
    assert (out / "source-fp8" / weights.name).stat().st_ino == weights.stat().st_ino  # a link, not a copy
    recorded = json.loads((out / "provenance.json").read_text())["source-fp8"]
    assert recorded["options"] == json.loads(json.dumps(stage.provenance()))
    other = _stages({"calibrate": {**block, "calib_tokens": 128}}, tmp_path / "out2", src=str(tiny_llama))[0]
    other.prebuilt = built
    log = run_stages([other], overwrite=True)
    assert not log[0].get("reused") and (tmp_path / "out2" / "source-fp8" / "manifest.json").is_file()
    assert next((tmp_path / "out2" / "source-fp8").glob("*.safetensors")).stat().st_ino != weights.stat().st_ino


def test_a_llamacpp_cache_ships_a_gguf_with_the_flags_that_serve_it(tmp_path):
    """--kv-dtype in one of llama.cpp's types: the calibrated model is also written as GGUF for stock llama.cpp
    (kvconvert export-gguf), before validation; --target names the engine and must serve the format."""
    from kvconvert.pipeline import PipelineOptions, _from_options, llamacpp_flags

    opts = PipelineOptions(mla=False, kv_dtype="iq4_nl", target="llamacpp")
    stages = _from_options("smollm2-135m", opts, tmp_path, frozenset({"mla", "kv_dtype", "target"}))
    assert [s.name for s in stages] == ["calibrate", "export", "validate", "gate"]
    assert stages[1].argv == ["export-gguf", "--src", str(tmp_path / "source-iq4_nl"), "--out",
                              str(tmp_path / "source-iq4_nl.gguf"), "--overwrite"]
    assert llamacpp_flags("iq4_nl", "m.gguf") == "llama-cli -m m.gguf -ctk iq4_nl -ctv iq4_nl -fa on"
    with pytest.raises(KVConvertError, match="vllm does not serve it"):
        _from_options("smollm2-135m", PipelineOptions(mla=False, kv_dtype="q4_0", target="vllm"), tmp_path,
                      frozenset({"mla", "kv_dtype", "target"}))
    with pytest.raises(KVConvertError, match="llama.cpp has no NVFP4 cache"):
        llamacpp_flags("nvfp4", "m.gguf")


def test_a_llamacpp_pair_ships_a_gguf_with_its_k_and_v_flags(tmp_path):
    """--kv-dtype q5_0/iq4_nl: calibrated and written as GGUF under a K+V name, served with -ctk q5_0 -ctv iq4_nl;
    refused up front for an MLA conversion (its row lives in llama.cpp's K cache) and by vLLM, by name."""
    from kvconvert.pipeline import PipelineOptions, _from_options, llamacpp_flags

    opts = PipelineOptions(mla=False, kv_dtype="q5_0/iq4_nl", target="llamacpp")
    stages = _from_options("smollm2-135m", opts, tmp_path, frozenset({"mla", "kv_dtype", "target"}))
    assert [s.name for s in stages] == ["calibrate", "export", "validate", "gate"]
    assert stages[0].options.kv_dtype == "q5_0/iq4_nl" and stages[0].out == tmp_path / "source-q5_0+iq4_nl"
    assert stages[1].argv[-2] == str(tmp_path / "source-q5_0+iq4_nl.gguf")
    assert stages[2].options.kv_dtype == "q5_0/iq4_nl"
    assert llamacpp_flags("q5_0/iq4_nl", "m.gguf") == "llama-cli -m m.gguf -ctk q5_0 -ctv iq4_nl -fa on"
    with pytest.raises(KVConvertError, match="vllm stores K and V in one cache dtype"):
        _from_options("smollm2-135m", PipelineOptions(mla=False, kv_dtype="q5_0/iq4_nl", target="vllm"), tmp_path,
                      frozenset({"mla", "kv_dtype", "target"}))
    with pytest.raises(KVConvertError, match="MLA model caches one row"):
        _from_options("smollm2-135m", PipelineOptions(kv_dtype="q5_0/iq4_nl", target="llamacpp", rank=256,
                                                      rope_dim=64), tmp_path,
                      frozenset({"kv_dtype", "target", "rank", "rope_dim"}))


def test_a_recipe_names_a_kv_pair(tmp_path):
    """A recipe's calibrate block takes K and V apart; validation runs the same pair; with an MLA conversion the pair
    is refused before any stage (the row lives in llama.cpp's K cache)."""
    stages = _stages({"calibrate": {"kv_dtype": "q8_0/iq4_nl"}}, tmp_path)
    assert [s.name for s in stages] == ["calibrate", "export", "validate", "gate"]
    assert stages[0].options.kv_dtype == stages[2].options.kv_dtype == "q8_0/iq4_nl"
    assert _params(stages[2])["candidate"] == str(tmp_path / "source-q8_0+iq4_nl")
    with pytest.raises(KVConvertError, match="MLA model caches one row"):
        _stages({"convert": {"rank": 64}, "calibrate": {"kv_dtype": "q8_0/iq4_nl"}}, tmp_path)
