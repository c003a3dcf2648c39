"""kvconvert plan: candidates, budget fitting, target filtering, pruning, the recipe written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from kvconvert.errors import KVConvertError
from kvconvert.pipeline import recipe_stages
from kvconvert.plan import (PlanOptions, chosen_recipe, enumerate_candidates, finished_plan, fits, mla_shapes,
                            dominated_by, pareto_front, parse_budget, prune, run_plan, why_dominated)
from kvconvert.kvmath import kv_shape
from kvconvert.recipe import load_recipe

# SmolLM2-135M's attention: 30 layers, 9 query heads, 3 KV heads of 64 -> 23040 bf16 bytes per token
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


def by_name(candidates):
    return {c.name: c for c in candidates}


def test_candidates_count_bytes_and_engines():
    c = by_name(enumerate_candidates(SMOLLM2))
    assert c["source bf16"].bytes_per_token == 23040
    assert c["source fp8"].fraction == 0.5
    assert c["source nvfp4"].fraction == pytest.approx(36 / 128)  # 32 bytes of codes + 4 block scales per 64 values
    assert c["source nvfp4"].engines == ("tensorrt-llm", "kvconvert")  # vLLM has no static NVFP4 KV scheme
    assert c["MLA 256+64 fp8"].fraction == pytest.approx(320 / 768)
    assert c["MLA 256+64 fp8"].engines == ("vllm", "kvconvert")
    assert c["MLA 256+64 nvfp4"].engines == ("kvconvert",)  # vLLM refuses NVFP4 with MLA
    # 4-bit MLA keeps k_rope in 16 bits: 128 + 8 bytes of latent, 128 of k_rope, per layer
    assert c["MLA 256+64 nvfp4"].bytes_per_token == 30 * (128 + 16 + 128)
    assert c["MLA 160+32 bf16"].fraction == 0.5 and c["MLA 160+32 bf16"].engines == ("llamacpp", "kvconvert")
    # llama.cpp's types: blocks of 32 with an fp16 scale, the whole MLA row alike, in rank and rope of whole blocks
    assert c["source q4_0"].fraction == pytest.approx(36 / 128) and c["source q4_0"].engines == ("llamacpp", "kvconvert")
    assert c["MLA 256+64 q4_0"].bytes_per_token == 30 * 320 // 32 * 18
    assert "MLA 304+16 q4_0" not in c  # 304 is no whole number of blocks of 32
    assert "MLA 312+8 nvfp4" not in c and "MLA 312+8 fp8" in c  # NVFP4 needs the rank in whole groups of 16


def test_research_shapes_include_the_benchmarked_ones_and_stay_below_the_source_width():
    shapes = mla_shapes(kv_shape(SMOLLM2))
    assert {(160, 32), (96, 32), (64, 32), (32, 16), (256, 64)} <= set(shapes)
    assert all(r + p < 384 for r, p in shapes)


def test_budget_and_target_filter():
    everything = enumerate_candidates(SMOLLM2)
    vllm = by_name(fits(everything, 0.5, "vllm"))
    assert set(vllm) == {"source fp8", "MLA 256+64 fp8", "MLA 288+32 fp8", "MLA 304+16 fp8", "MLA 312+8 fp8"}
    trt = by_name(fits(everything, 0.5, "tensorrt-llm"))
    assert set(trt) == {"source fp8", "source nvfp4"}  # no 512 + 64 latent fits SmolLM2's 384 K+V values
    assert "MLA 160+32 bf16" in by_name(fits(everything, 0.5, "kvconvert"))
    assert all(c.fraction <= 0.25 for c in fits(everything, 0.25, "any"))
    with pytest.raises(KVConvertError, match="--target"):
        fits(everything, 0.5, "sglang")


def test_pruning_keeps_only_what_no_candidate_beats_by_construction():
    survivors, pruned = prune(fits(enumerate_candidates(SMOLLM2), 0.5, "vllm"))
    assert [c.name for c in survivors] == ["source fp8"]  # don't convert, just quantize
    assert set(pruned.values()) == {"source fp8"}
    survivors, pruned = prune(fits(enumerate_candidates(SMOLLM2), 0.25, "any"))
    assert pruned["MLA 192+32 nvfp4"] == "MLA 224+32 nvfp4"  # a survivor, not the next shape up
    # no source format fits 25% (nvfp4 is 28.1%); per format the MLA shapes no larger shape contains
    # nvfp4_fp8rope's 8-bit k_rope buys shapes with wide RoPE parts (224+64) at these bytes too
    # llama.cpp's formats add their own chains (q8_0 < q5_0 < q4_0, q8_0 < iq4_nl, q5_1 < q4_1): not ordered
    # against the NVIDIA formats, nor iq4_nl against q4_0
    assert {c.name for c in survivors} == {"MLA 64+32 bf16", "MLA 160+32 fp8", "MLA 224+32 nvfp4",
                                           "MLA 224+64 nvfp4_fp8rope", "MLA 272+32 nvfp4_fp8rope",
                                           "MLA 304+16 nvfp4_fp8rope", "MLA 128+32 q8_0", "MLA 224+32 q5_0",
                                           "MLA 224+32 q5_1", "MLA 256+32 q4_1", "MLA 256+64 iq4_nl",
                                           "MLA 256+64 q4_0", "MLA 288+32 iq4_nl", "MLA 288+32 q4_0"}
    names = {c.name for c in enumerate_candidates(SMOLLM2)}
    assert "MLA 224+64 nvfp4_fp8rope" in names and "MLA 224+64 nvfp4" not in names  # wide RoPE: 8-bit k_rope only
    assert not any(n.startswith("source nvfp4_fp8rope") for n in names)  # MLA-only
    survivors, pruned = prune(fits(enumerate_candidates(SMOLLM2), 0.5, "any"))
    # llama.cpp's K/V pairs, half by half: q8_0/q5_0 beats q5_0 (a finer K, the same V), q8_0/iq4_nl beats iq4_nl
    assert {c.name for c in survivors} == {"source fp8", "MLA 160+32 bf16", "source q5_1", "MLA 256+64 q8_0",
                                           "MLA 320+32 q8_0", "source q8_0/q5_0", "source q8_0/q5_1",
                                           "source q8_0/iq4_nl", "source q5_1/q4_0", "source q5_1/iq4_nl"}
    assert pruned["source nvfp4"] == "source fp8" and pruned["source q4_0"] == "source q8_0/q5_0"
    assert pruned["source q5_0"] == "source q8_0/q5_0" and pruned["source iq4_nl"] == "source q8_0/iq4_nl"
    survivors, _ = prune(fits(enumerate_candidates(SMOLLM2), 0.3, "llamacpp"))  # source 4-bit; MLA in finer types
    assert {"source q4_0", "source iq4_nl"} <= {c.name for c in survivors}
    assert not [c for c in survivors if c.kind == "mla" and c.kv_dtype in ("q4_0", "iq4_nl")]  # the source's beat them


def test_why_dominated_names_the_rule():
    """The plan says why a cheaper candidate is not measured: what dominates it, by which construction."""
    c = by_name(enumerate_candidates(SMOLLM2))
    src_fp8, src_nvfp4, mla256, mla160 = c["source fp8"], c["source nvfp4"], c["MLA 256+64 fp8"], c["MLA 160+32 fp8"]
    assert dominated_by(src_nvfp4, src_fp8) and "finer format (fp8 < nvfp4)" in why_dominated(src_nvfp4, src_fp8)
    assert dominated_by(mla256, src_fp8) and "without the MLA conversion's error" in why_dominated(mla256, src_fp8)
    assert dominated_by(mla160, mla256) and "256+64 >= 160+32" in why_dominated(mla160, mla256)


def test_pareto_front():
    assert pareto_front([(1, 1), (2, 0.5), (2, 2), (3, 0.5), (0.5, 3)]) == [0, 1, 4]
    assert pareto_front([(1, 1), (1, 1)]) == [0]


def test_label_drops_stack_only_labels_that_would_overlap():
    from kvconvert.plan import label_drops

    # 12.4% and 16.5% at nearly the same KL collide (the second drops a line, the third two); a point a decade
    # lower, or one 40% of the bytes away, keeps its label in place
    assert label_drops([(12.4, 0.75), (16.5, 0.73), (18.8, 0.69), (20.1, 0.075), (60.0, 0.7)]) == [0, 1, 2, 0, 0]
    assert label_drops([]) == []


@pytest.mark.parametrize("text, value", [("25%", 0.25), ("0.5", 0.5), (" 99% ", 0.99)])
def test_parse_budget(text, value):
    assert parse_budget(text) == value


@pytest.mark.parametrize("text", ["0", "150%", "a lot", "-5%", "100%", "1.0"])
def test_parse_budget_refuses(text):
    """100% is the source's own bf16 cache: the plan would choose it and build nothing (the pipeline then
    refused its own recipe, which has no convert or calibrate block)."""
    with pytest.raises(KVConvertError, match="--kv-budget"):
        parse_budget(text)


def test_recipes_written_run_in_the_pipeline(tmp_path):
    c = by_name(enumerate_candidates(SMOLLM2))
    for name, stages_expected in (("source fp8", ["calibrate"]), ("MLA 256+64 fp8", ["convert", "calibrate"]),
                                  ("MLA 160+32 bf16", ["convert"])):
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(chosen_recipe(c[name], "smollm2-135m", "vllm", 2048, "fp32")))
        recipe = load_recipe(path)
        stages = recipe_stages(recipe, path, "smollm2-135m", tmp_path / "out")
        assert [s.name for s in stages] == [*stages_expected, "validate", "gate"]
        validate = next(s for s in stages if s.name == "validate")
        assert validate.options.kv_dtype == ("auto" if name.endswith("bf16") else "fp8")
        if recipe.convert is not None:  # vLLM serves 256 + 64; 160 + 32 only the runtime
            assert recipe.convert.target == ("vllm" if name.startswith("MLA 256") else "any")


@pytest.mark.parametrize("kv_calib_tokens", [None, 1024])
def test_the_plan_builds_with_the_options_its_recipe_ships(kv_calib_tokens, tmp_path):
    """What the plan builds and measures (recipe_blocks on `device`) is, option for option, what the pipeline's
    stages of the recipe it writes would build: the provenance records match, so the pipeline reuses the build."""
    from kvconvert.checkpoint.provenance import stage_record
    from kvconvert.mla.options import MLAOptions
    from kvconvert.plan import recipe_blocks
    from kvconvert.quant.options import CalibrateOptions

    c = by_name(enumerate_candidates(SMOLLM2))["MLA 256+64 fp8"]
    blocks = recipe_blocks(c, "vllm", 2048, "fp32", kv_calib_tokens)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(chosen_recipe(c, "smollm2-135m", "vllm", 2048, "fp32", kv_calib_tokens)))
    stages = {s.name: s for s in recipe_stages(load_recipe(path), path, "smollm2-135m", tmp_path, device="cpu")}
    assert stages["convert"].provenance() == stage_record("convert", MLAOptions(**blocks["convert"]), heal=None)
    made = CalibrateOptions(**blocks["calibrate"], device="cuda")  # the device moves the work, not what is made
    assert stages["calibrate"].provenance() == stage_record("calibrate", made)
    assert made.calib_tokens == (kv_calib_tokens or CalibrateOptions().calib_tokens) and made.observer == "mse"


def test_already_mla_source_is_refused():
    mla = {**SMOLLM2, "kv_lora_rank": 160, "qk_rope_head_dim": 32}
    with pytest.raises(KVConvertError, match="already MLA"):
        enumerate_candidates(mla)


# The formats vLLM and the runtime serve (llama.cpp's are planned in test_plan_llamacpp_target_*): what these
# end-to-end plans measure stays two candidates.
QUICK = PlanOptions(target="any", kv_dtypes=("bf16", "fp8", "nvfp4", "nvfp4_fp8rope"), quality_eval_tokens=256,
                    window_len=128, calib_tokens=512, kv_calib_tokens=1024)


def test_plan_options_are_the_commands_flags():
    from click.testing import CliRunner

    from kvconvert.commands.plan import plan_cmd

    help_text = CliRunner().invoke(plan_cmd, ["--help"]).output
    for flag in ("--target", "--quality-eval-tokens", "--window-len", "--calib-tokens", "--measure-dominated",
                 "--dtype", "--device"):
        assert flag in help_text
    result = CliRunner().invoke(plan_cmd, ["--kv-budget", "50%", "--calib-tokens", "100"])
    assert isinstance(result.exception, KVConvertError) and "--calib-tokens" in str(result.exception)


def test_finished_plan_needs_its_recipe_and_readable_options(tmp_path):
    from kvconvert.plan import PLAN_FORMAT, plan_problem

    made = {"format": PLAN_FORMAT, "budget": 0.5, "options": PlanOptions().model_dump(),
            "recipe": {"calibrate": {"kv_dtype": "fp8"}}}
    (tmp_path / "plan.json").write_text(json.dumps(made))
    assert not finished_plan(tmp_path, 0.5, PlanOptions())  # no recipe.yaml: the run stopped before it
    (tmp_path / "recipe.yaml").write_text("calibrate: {kv_dtype: fp8}\n")
    assert finished_plan(tmp_path, 0.5, PlanOptions())
    (tmp_path / "recipe.yaml").write_text("calibrate: {kv_dtype: nvfp4}\n")  # edited by hand: not what was measured
    assert plan_problem(tmp_path, 0.5, PlanOptions()).endswith(
        "recipe.yaml was edited since the plan chose it (calibrate.kv_dtype \"fp8\" -> \"nvfp4\"): the plan measured "
        "another recipe")
    (tmp_path / "recipe.yaml").write_text("calibrate: {kv_dtype: fp8}\n")
    (tmp_path / "plan.json").write_text(json.dumps({**made, "format": 1}))  # candidates built another way
    assert not finished_plan(tmp_path, 0.5, PlanOptions())
    (tmp_path / "plan.json").write_text(json.dumps({"budget": 0.5, "target": "vllm"}))  # before plan kept its options
    assert not finished_plan(tmp_path, 0.5, PlanOptions())
    (tmp_path / "plan.json").write_text(json.dumps({"budget": 0.5, "options": {"windows": 4}}))  # another version's
    assert not finished_plan(tmp_path, 0.5, PlanOptions())


def test_weights_keep_the_sources_dtype(tmp_path, smollm2_path):
    """auto: a bf16 checkpoint is converted and scored in bf16 (a 7B in fp32 would not fit a 24 GB machine),
    the built-in SmolLM2 (stored in fp32) in fp32; an explicit choice wins."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvconvert.plan import weights_dtype

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert weights_dtype(tmp_path / "bf16", "auto") == "bf16"
    assert weights_dtype(tmp_path / "bf16", "fp32") == "fp32"
    assert weights_dtype(smollm2_path, "auto") == "fp32"
    recipe = chosen_recipe(by_name(enumerate_candidates(SMOLLM2))["MLA 160+32 bf16"], "m", "any", 2048, "bf16")
    assert recipe["convert"]["dtype"] == "bf16"


def test_disk_needed_counts_each_missing_checkpoint_once(tmp_path, smollm2_path):
    from kvconvert.checkpoint import estimate_checkpoint_bytes
    from kvconvert.plan import artifact_folders, disk_needed

    c = by_name(enumerate_candidates(SMOLLM2))
    chosen = [c["source fp8"], c["MLA 160+32 bf16"], c["MLA 160+32 fp8"], c["source bf16"]]
    copy = estimate_checkpoint_bytes(smollm2_path, untie=True)  # SmolLM2 is stored in fp32: bf16 copies are smaller
    assert disk_needed(chosen, smollm2_path, tmp_path, "bf16") == 3 * copy  # source-fp8, mla-160-32, mla-160-32-fp8
    assert disk_needed([c["source bf16"]], smollm2_path, tmp_path, "fp32") == 0  # scored as it is
    model, _ = artifact_folders(c["MLA 160+32 fp8"], smollm2_path, tmp_path)
    model.mkdir()
    (model / "manifest.json").write_text("{}")  # built by an earlier run: reused, not written again
    assert disk_needed(chosen, smollm2_path, tmp_path, "fp32") == 2 * copy


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_a_missing_gpu_is_refused_before_any_work(tmp_path):
    from click.testing import CliRunner

    from kvconvert.commands.plan import plan_cmd

    result = CliRunner().invoke(plan_cmd, ["--kv-budget", "50%", "--device", "cuda", "--out", str(tmp_path / "p")])
    assert isinstance(result.exception, KVConvertError) and "torch sees none" in str(result.exception)
    assert not (tmp_path / "p").exists()


@pytest.mark.slow
def test_nothing_fits_says_the_smallest(tmp_path):
    with pytest.raises(KVConvertError, match=r"smallest is MLA 256\+64 fp8 at 41\.7%"):
        run_plan("smollm2-135m", 0.3, QUICK.model_copy(update={"target": "vllm"}), tmp_path, echo=lambda m: None)
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.slow
def test_plan_end_to_end_on_smollm2(tmp_path):
    opts = QUICK.model_copy(update={"device": "cpu"})
    run_plan("smollm2-135m", 0.5, opts, tmp_path, echo=lambda m: None)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["device"] == "cpu" and PlanOptions(**plan["options"]) == opts
    assert plan["sensitivity"] is None  # vLLM serves no K/V pair: nothing to choose between the halves
    assert finished_plan(tmp_path, 0.5, opts.model_copy(update={"device": "auto"}))  # where, not what it measured
    assert not finished_plan(tmp_path, 0.25, opts)
    assert (tmp_path / "artifacts" / "fp32-512" / "source-fp8" / "manifest.json").is_file()  # SmolLM2 stores fp32
    assert not finished_plan(tmp_path, 0.5, opts.model_copy(update={"calib_tokens": 1024}))
    rows = {r["name"]: r for r in plan["rows"]}
    measured = {name for name, r in rows.items() if r.get("kl") is not None}
    assert measured == {"source fp8", "MLA 160+32 bf16"}  # the survivors only
    assert plan["chosen"] == "source fp8" and plan["verdict"].startswith("don't convert, just quantize")
    assert rows["source fp8"]["kl"] < rows["MLA 160+32 bf16"]["kl"]
    assert rows["source nvfp4"]["status"] == ("not measured: dominated by source fp8 (the same cached values in a "
                                              "finer format (fp8 < nvfp4))")
    assert load_recipe(tmp_path / "recipe.yaml").calibrate.kv_dtype == "fp8"
    assert load_recipe(tmp_path / "recipe.yaml").calibrate.calib_tokens == 1024  # what the plan calibrated with
    assert plan["artifacts"] == {"convert": None, "heal": None,
                                 "calibrate": str(tmp_path / "artifacts" / "fp32-512" / "source-fp8")}
    assert (tmp_path / "plan.png").stat().st_size > 10_000


def test_kv_dtypes_limits_the_formats_and_names_the_known_ones(tmp_path):
    """--kv-dtypes fp8,q4_0 plans among those formats only; an unknown one is refused naming every known format, and
    a set the target serves none of says so before any work."""
    with pytest.raises(ValidationError, match=r"fp9: not a KV format plan measures; choose from bf16, fp8, nvfp4"):
        PlanOptions(kv_dtypes=("fp9",))
    with pytest.raises(ValidationError, match="at least one KV format"):
        PlanOptions(kv_dtypes=())
    with pytest.raises(KVConvertError, match="vllm serves none of --kv-dtypes q4_0,iq4_nl"):
        run_plan("smollm2-135m", 0.3, QUICK.model_copy(update={"target": "vllm", "kv_dtypes": ("q4_0", "iq4_nl")}),
                 tmp_path, echo=lambda m: None)
    assert not (tmp_path / "plan.json").exists()


def test_a_kv_dtype_the_target_does_not_serve_is_named_not_dropped(tmp_path):
    """--kv-dtypes "fp8, q4_0" --target vllm: vLLM has no q4_0 cache, so the plan leaves q4_0 out, and says so."""
    said = []
    with pytest.raises(KVConvertError, match="nothing vllm serves fits"):  # 30%: the note comes first
        run_plan("smollm2-135m", 0.3, QUICK.model_copy(update={"target": "vllm", "kv_dtypes": ("fp8", "q4_0")}),
                 tmp_path, echo=said.append)
    assert said[0] == ("note: --kv-dtypes q4_0 left out: vllm serves no candidate with it (served by llamacpp, "
                       "kvconvert: --target llamacpp, or --target any)")
    assert not [s for s in said if "fp8 left out" in s]


def test_llamacpp_plans_k_and_v_apart_for_the_source():
    """K/V pairs (q5_0/iq4_nl: -ctk q5_0 -ctv iq4_nl) are llama.cpp candidates for the source's own attention, their
    bytes the sum of both halves; no MLA pair (one row in the K cache); a pair is pruned half by half."""
    c = by_name(enumerate_candidates(SMOLLM2))
    pair = c["source q5_0/iq4_nl"]
    assert pair.fraction == pytest.approx((22 + 18) / 2 / 32 / 2) and pair.engines == ("llamacpp", "kvconvert")
    assert "source iq4_nl/q5_0" not in c  # default pairs: K with more bits than V; --kv-dtypes may name any
    assert not any("/" in name for name in c if name.startswith("MLA"))
    assert "source q5_0/iq4_nl" not in by_name(fits(list(c.values()), 0.5, "vllm"))
    survivors, pruned = prune(fits(list(c.values()), 0.32, "llamacpp"))
    assert {"source q5_0/iq4_nl", "source q5_0/q4_0", "source iq4_nl"} <= {s.name for s in survivors}
    assert pruned["source q4_0"] == "source q5_0/q4_0"  # the same V, a finer K
    assert dominated_by(c["source q8_0/q4_0"], c["source q8_0/q5_0"])
    assert not dominated_by(c["source q5_0/iq4_nl"], c["source q8_0/q4_0"])  # iq4_nl and q4_0: not ordered
    assert PlanOptions(kv_dtypes=("IQ4_NL/Q5_0", "q4_0/q4_0")).kv_dtypes == ("iq4_nl/q5_0", "q4_0")
    with pytest.raises(ValidationError, match="not a KV format plan measures"):
        PlanOptions(kv_dtypes=("fp8/q4_0",))


def test_llamacpp_candidates_keep_to_its_one_shape_rule():
    """A head_dim llama.cpp's blocks of 32 do not tile is no candidate for its types (plan asks targets' rule)."""
    c = by_name(enumerate_candidates({**SMOLLM2, "head_dim": 48, "hidden_size": 432}))
    assert "source q4_0" not in c and "source q5_0/iq4_nl" not in c and "source fp8" in c


def test_named_pairs_are_planned_whichever_half_has_more_bits():
    """--kv-dtypes iq4_nl/q5_0 (V finer than K) is a candidate as named, with no sensitivity measured; pairs are
    planned only for targets that serve them."""
    from kvconvert.plan import PAIRS, llamacpp_pairs, plan_pairs

    assert "source iq4_nl/q5_0" in by_name(enumerate_candidates(SMOLLM2, ("iq4_nl/q5_0",)))
    assert "source q5_0/iq4_nl" not in by_name(enumerate_candidates(SMOLLM2, ("iq4_nl/q5_0",)))
    opts = PlanOptions(target="llamacpp", kv_dtypes=("iq4_nl/q5_0", "q4_0"))
    assert plan_pairs(Path("/nonexistent"), opts, "fp32") == (("iq4_nl/q5_0",), None)
    assert PAIRS == llamacpp_pairs("k") and "q5_0/iq4_nl" in PAIRS and "q8_0/q4_0" in PAIRS
    assert "iq4_nl/q5_0" in llamacpp_pairs("v") and not set(llamacpp_pairs("v")) & set(PAIRS)


@pytest.mark.parametrize("score_gain, finer_half", [(0.02, "v"), (8.0, "k")])
def test_the_plan_gives_the_extra_bits_to_the_half_that_costs_more(score_gain, finer_half, tmp_path):
    """A model whose scores barely depend on its keys (k_proj scaled down: near-uniform attention) loses more to
    rounded values, and one with sharp attention (q_proj and k_proj scaled up) to rounded keys: the plan measures which
    (kvconvert.quant.sensitivity, K-only and V-only iq4_nl) and plans the pairs that favour that half."""
    import sys

    import torch
    from safetensors.torch import load_file, save_file

    from kvconvert.plan import llamacpp_pairs, plan_pairs

    sys.path.insert(0, str(Path(__file__).parent / "quant"))
    from quant_cases import make_llama

    src = make_llama(tmp_path / "llama", head_dim=32)
    shard = next(src.glob("*.safetensors"))
    weights = load_file(shard)
    for name in weights:
        if name.endswith("k_proj.weight") or (score_gain > 1 and name.endswith("q_proj.weight")):
            weights[name] = (weights[name] * score_gain).contiguous()
    save_file(weights, shard, metadata={"format": "pt"})
    pairs, measured = plan_pairs(src, PlanOptions(target="llamacpp", window_len=64), "fp32")
    assert measured["finer_half"] == finer_half and pairs == llamacpp_pairs(finer_half)
    worse, better = ("v_only", "k_only") if finer_half == "v" else ("k_only", "v_only")
    assert measured[worse] > measured[better] > 0
    assert plan_pairs(src, PlanOptions(target="vllm", window_len=64), "fp32") == ((), None)


def test_a_heal_budget_heals_the_chosen_source_and_ships_it_only_when_it_loses_less():
    """--heal-tokens: the chosen source candidate taught its cache is one more candidate, built by the recipe's
    heal_distill block (its kv_dtype, lr 1e-4) before the calibration; an MLA choice or a bf16 cache spends nothing;
    the healed model is chosen only when its paired KL change is below zero by 2 standard errors."""
    from kvconvert.plan import artifact_folders, healed_candidate, heal_verdict, paired_change, recipe_blocks

    c = by_name(enumerate_candidates(SMOLLM2))
    healed, why = healed_candidate(c["source q5_0/iq4_nl"], 4096)
    assert why is None and healed.name == "source q5_0/iq4_nl healed 4096"
    assert healed.fraction == c["source q5_0/iq4_nl"].fraction
    assert healed_candidate(c["source q5_0/iq4_nl"], 0) == (None, None)
    assert "MLA conversion" in healed_candidate(c["MLA 160+32 fp8"], 4096)[1]
    assert "bf16" in healed_candidate(c["source bf16"], 4096)[1]
    blocks = recipe_blocks(healed, "llamacpp", 2048, "fp32")
    assert blocks == {"heal_distill": {"kv_dtype": "q5_0/iq4_nl", "tokens": 4096, "lr": 1e-4},
                      "calibrate": {"kv_dtype": "q5_0/iq4_nl"}}
    model, scored = artifact_folders(healed, Path("src"), Path("w"))
    assert (model, scored) == (Path("w/healed-4096-q5_0+iq4_nl"), Path("w/healed-4096-q5_0+iq4_nl-q5_0+iq4_nl"))
    recipe = chosen_recipe(healed, "smollm2-135m", "llamacpp", 2048, "fp32")
    stages = recipe_stages(load_recipe_dict(recipe), Path("r.yaml"), "smollm2-135m", Path("out"))
    assert [s.name for s in stages] == ["heal", "calibrate", "export", "validate", "gate"]

    lower = paired_change([0.020, 0.030, 0.025, 0.028], [0.018, 0.027, 0.023, 0.025])
    assert lower["mean"] == pytest.approx(-0.0025) and lower["windows"] == 4
    assert heal_verdict(lower).startswith("healed: KL change -0.0025")
    noisy = paired_change([0.020, 0.030, 0.025, 0.028], [0.015, 0.033, 0.022, 0.029])
    assert heal_verdict(noisy).startswith("the heal did not lower the KL by 2 standard errors")


def load_recipe_dict(data: dict):
    from kvconvert.recipe import parse_recipe

    return parse_recipe(data, "plan")


def test_plan_with_a_heal_budget_measures_the_healed_source(tmp_path):
    """A real plan on a small Llama (head_dim 32, llama.cpp's q8_0): the healed source is built by the heal, scored
    on the same windows with its per-window KL, recorded beside the candidate it heals, and its build is what the
    pipeline's heal stage would reuse (the same provenance record)."""
    import sys

    from kvconvert.checkpoint.provenance import reuse_problem

    sys.path.insert(0, str(Path(__file__).parent / "quant"))
    from quant_cases import make_llama

    src = make_llama(tmp_path / "llama", head_dim=32)
    opts = PlanOptions(target="llamacpp", kv_dtypes=("q8_0",), quality_eval_tokens=256, window_len=64,
                       kv_calib_tokens=512, heal_tokens=256, device="cpu")
    plan = run_plan(str(src), 0.6, opts, tmp_path / "plan", echo=lambda m: None)
    rows = {r["name"]: r for r in plan["rows"]}
    healed = rows["source q8_0 healed 256"]
    assert len(healed["window_kls"]) == 4 and healed["paired_kl_change"]["windows"] == 4
    assert healed["kl"] != rows["source q8_0"]["kl"]  # the heal changed the model
    assert plan["chosen"] in ("source q8_0", "source q8_0 healed 256") and plan["heal"]
    folder = tmp_path / "plan" / "artifacts" / "fp32-2048" / "healed-256-q8_0"
    assert (folder / "manifest.json").is_file()
    stages = recipe_stages(load_recipe_dict({"heal_distill": {"kv_dtype": "q8_0", "tokens": 256, "lr": 1e-4},
                                             "calibrate": {"kv_dtype": "q8_0"}}), Path("r.yaml"), str(src), tmp_path)
    assert reuse_problem(folder, src, stages[0].provenance()) is None
