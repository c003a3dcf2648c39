"""A heal's faults, each a clear error before any work or a correct result: damaged saved progress named with
the way out (--restart), a truncated compressed data file named (not read as Ctrl-C), mix weights a float cannot
hold, `heal --plan` budgets that round to the same run, a plan whose target is already met (valid JSON), a broken
line met mid-run (what fixing it means for the progress, said up front), and sequences beyond the model's positions."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
import torch
from heal_cases import distill_recipe

from kvconvert.errors import KVConvertError
from kvconvert.heal.api import state_dir_for
from kvconvert.recipe import heal


def _stopped_heal(student, teacher, text_file, out: Path) -> Path:
    """A heal stopped after two steps, its progress saved: the state area."""
    rep = heal(student, teacher, distill_recipe(text_file, checkpoint_every=1), out, progress=False, max_steps=2)
    assert rep["finished"] is False
    return state_dir_for(out)


@pytest.mark.parametrize("damage", ["truncated", "random", "empty"])
def test_damaged_distill_state_is_named(tiny_student, tiny_teacher, text_file, tmp_path, damage):
    state = _stopped_heal(tiny_student, tiny_teacher, text_file, tmp_path / "out") / "distill" / "distill_state.pt"
    data = state.read_bytes()
    noise = random.Random(0).randbytes(4096)
    state.write_bytes({"truncated": data[:len(data) // 2], "random": noise, "empty": b""}[damage])
    with pytest.raises(KVConvertError, match=r"distill_state\.pt: saved progress of an interrupted heal is damaged "
                                             r".*--restart"):
        heal(tiny_student, tiny_teacher, distill_recipe(text_file, checkpoint_every=1), tmp_path / "out",
             progress=False, max_steps=3)
    rep = heal(tiny_student, tiny_teacher, distill_recipe(text_file, checkpoint_every=1), tmp_path / "out",
               progress=False, max_steps=3, restart=True)
    assert rep["stages"]["heal_distill"]["resumed_at_step"] == 0


def test_any_damage_to_a_torch_state_file_is_named(tmp_path):
    """Random bytes trip the weights-only unpickler in many ways (UnpicklingError, EOFError, but also IndexError,
    KeyError, ...): every one is named as damaged saved progress, never a traceback. 300 seeded byte strings."""
    from kvconvert.heal.state import load_torch_state

    path = tmp_path / "distill_state.pt"
    for seed in range(300):
        rng = random.Random(seed)
        path.write_bytes(rng.randbytes(rng.randint(1, 4096)))
        with pytest.raises(KVConvertError, match=r"distill_state\.pt: saved progress of an interrupted heal is damaged"):
            load_torch_state(path)


def test_corrupt_run_record_is_named_not_restarted(tiny_student, tiny_teacher, text_file, tmp_path):
    state = _stopped_heal(tiny_student, tiny_teacher, text_file, tmp_path / "out")
    (state / "run.json").write_text('{"heal_distill": ')
    with pytest.raises(KVConvertError, match=r"run\.json: saved progress .* damaged \(JSONDecodeError.*--restart"):
        heal(tiny_student, tiny_teacher, distill_recipe(text_file, checkpoint_every=1), tmp_path / "out",
             progress=False, max_steps=3)


def test_damaged_layerwise_state_is_named(tmp_path):
    """The layer-wise stage's own files: a truncated stream.safetensors and a broken progress.json."""
    from kvconvert.heal.layerwise import LayerwiseState

    lw = LayerwiseState(tmp_path / "layerwise", "fp")
    lw.save_layer(0, {"w": torch.ones(4, 4)}, {"layer": 0}, torch.ones(2, 8), torch.zeros(2, 8))
    assert lw.done() == 1 and torch.equal(lw.load_stream()[0], torch.ones(2, 8))
    stream = tmp_path / "layerwise" / "stream.safetensors"
    stream.write_bytes(stream.read_bytes()[:40])
    with pytest.raises(KVConvertError, match=r"stream\.safetensors: saved progress .* damaged .*--restart"):
        lw.load_stream()
    (tmp_path / "layerwise" / "progress.json").write_text('{"done": 1, "finger')
    with pytest.raises(KVConvertError, match=r"progress\.json: saved progress .* damaged .*--restart"):
        lw.done()


def _truncated_gz(text_file: Path, folder: Path) -> Path:
    lines = "".join(json.dumps({"text": p}) + "\n" for p in text_file.read_text().split("\n\n") if p.strip())
    whole = gzip.compress(lines.encode())
    path = folder / "data.jsonl.gz"
    path.write_bytes(whole[:300])  # a few hundred bytes of text, then the end of the file
    return path


def test_a_truncated_gz_is_named_not_read_as_ctrl_c(tiny_student, tiny_teacher, text_file, tmp_path, capsys):
    """gzip's EOFError, which click turns into its Ctrl-C abort (exit 130, "Interrupted"), is a damaged data file:
    exit 2 naming it, from heal --distill-data and calibrate --calib-data alike."""
    from kvconvert.commands.main import main

    data = _truncated_gz(text_file, tmp_path)
    for argv in (["heal", "--student", str(tiny_student), "--teacher", str(tiny_teacher), "--recipe", "distill",
                  "--distill-data", str(data), "--distill-tokens", "512", "--distill-seq-len", "128",
                  "--out", str(tmp_path / "healed"), "--no-progress"],
                 ["calibrate", "--src", str(tiny_teacher), "--kv-dtype", "fp8", "--calib-data", str(data),
                  "--calib-tokens", "256", "--window-len", "128", "--out", str(tmp_path / "cal")]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2, err
        assert "data.jsonl.gz: the compressed file is truncated or damaged" in err and "Interrupted" not in err


@pytest.mark.parametrize("mix", ["inf*A+1*B", "nan*A+1*B", "1e308*A+1e308*B"])
def test_mix_weights_a_float_cannot_hold_are_refused(mix):
    from pydantic import ValidationError

    from kvconvert.heal.options import DistillOptions

    with pytest.raises(ValidationError, match=r"positive number \(finite\)|beyond a float.s range"):
        DistillOptions(data=mix.replace("A", "pydoc").replace("B", "wiki"))


def test_plan_budgets_that_round_to_the_same_run_are_refused_before_any(tiny_student, tiny_teacher, text_file,
                                                                        tmp_path):
    from kvconvert.heal.options import HealPlanOptions
    from kvconvert.heal.token_plan import plan_heal
    from kvconvert.recipe import resolve_recipe

    recipe = resolve_recipe(distill_recipe(text_file, batch_size=1))
    with pytest.raises(KVConvertError, match=r"100 -> 128, 200 -> 128, 300 -> 256, 2 distinct"):
        plan_heal(tiny_student, tiny_teacher, recipe, tmp_path / "plan", HealPlanOptions(budgets=(100, 200, 300)),
                  progress=False, echo=lambda *_: None)
    assert not (tmp_path / ".plan.heal-plan").exists()  # no run started


def test_plan_with_the_target_already_met_says_so_in_valid_json(tmp_path, text_file):
    """A source healed for a q8_0 cache: its KL is far below 0.05 before any distillation. The plan says the target
    is already reached (no "never ... inf h") and heal_plan.json holds no Infinity (strict JSON parses it)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
    from quant_cases import make_llama

    from kvconvert.heal.options import HealPlanOptions
    from kvconvert.heal.token_plan import plan_heal
    from kvconvert.recipe import resolve_recipe

    src = make_llama(tmp_path / "src", head_dim=64)
    lines = []
    recipe = resolve_recipe(distill_recipe(text_file, batch_size=1, kv_dtype="q8_0", lr=0.002))
    plan_heal(src, src, recipe, tmp_path / "plan", HealPlanOptions(budgets=(128, 256, 384), eval_windows=2,
                                                                    eval_window=128),
              progress=False, echo=lines.append)
    assert any("to KL 0.05: already reached (measured before distillation)" in line for line in lines), lines

    def no_constants(name):
        raise AssertionError(f"heal_plan.json holds {name}")
    plan = json.loads((tmp_path / "plan" / "heal_plan.json").read_text(), parse_constant=no_constants)
    assert plan["target"]["tokens"]["already_reached"] is True and 0 < plan["eval"]["kl_before"] < 0.05


def test_a_broken_line_met_mid_run_says_what_fixing_it_means(tiny_student, tiny_teacher, text_file, tmp_path,
                                                             monkeypatch):
    """The data is read as the run goes: a broken line in a later file stops the heal there, and the error says,
    before the user fixes it, that the saved progress will not resume on the fixed file (--restart). (Documents
    are tokenized 4K characters at a time here, not 256K, so a small file is read over many steps.)"""
    from kvconvert import token_stream
    from kvconvert.checkpoint import load_tokenizer
    from kvconvert.heal.distill import Distiller
    from kvconvert.heal.options import DistillOptions
    from kvconvert.text_sources import text_source
    from kvconvert.token_stream import WindowStream

    folder = tmp_path / "shards"
    folder.mkdir()
    rows = [json.dumps({"text": p}) + "\n" for p in text_file.read_text().split("\n\n") if p.strip()]
    (folder / "part-0.jsonl").write_text("".join(rows[:60]))
    (folder / "part-1.jsonl").write_text("".join(rows[60:70]) + '{"text": "broken\n' + "".join(rows[70:]))
    monkeypatch.setattr(token_stream, "TOKENIZE_CHARS", 4096)
    stage = DistillOptions(**distill_recipe(text_file, tokens=400 * 2 * 128, checkpoint_every=1)["heal_distill"])
    stream = WindowStream([(text_source(str(folder)), 1.0)], load_tokenizer(tiny_teacher), 128, block=8,
                          limit=stage.steps * 2)
    distiller = Distiller(tiny_student, tiny_teacher, stream, stage, tmp_path / "state", "fp", progress=False)
    with pytest.raises(KVConvertError, match=r"heal_distill stopped at step \d+: .*part-1\.jsonl:\d+: not valid JSON"
                                             r".*once the file is fixed it cannot be resumed: rerun with --restart"):
        distiller.run()
    assert distiller.step > 1  # it trained on the data before the broken line


def test_sequences_beyond_the_models_positions_are_refused(tiny_student, tiny_teacher, text_file, tmp_path):
    from kvconvert.heal.options import HealPlanOptions
    from kvconvert.heal.token_plan import plan_heal
    from kvconvert.recipe import resolve_recipe

    with pytest.raises(KVConvertError, match="--distill-seq-len 4096 is beyond the student's max_position_embeddings "
                                             "1024"):
        heal(tiny_student, tiny_teacher, distill_recipe(text_file, seq_len=4096), tmp_path / "out", progress=False)
    with pytest.raises(KVConvertError, match="--plan-eval-window 4096 is beyond the model's max_position_embeddings"):
        plan_heal(tiny_student, tiny_teacher, resolve_recipe(distill_recipe(text_file)), tmp_path / "plan",
                  HealPlanOptions(eval_window=4096), progress=False, echo=lambda *_: None)
