"""Bad inputs fail with one clear KVConvertError before any training starts."""

import shutil

import pytest

from kvconvert.errors import KVConvertError, OutputExistsError, UnsupportedModelError
from kvconvert.heal.api import heal, state_dir_for

from heal_cases import build_llama, build_tokenizer, convert_tiny, distill_recipe, layerwise_recipe


def _no_training_happened(out):
    assert not out.exists() and not state_dir_for(out).exists()


def test_student_is_not_mla(tiny_teacher, text_file, tmp_path):
    out = tmp_path / "o"
    with pytest.raises(UnsupportedModelError, match="not 'deepseek_v3'"):
        heal(tiny_teacher, tiny_teacher, layerwise_recipe(text_file), out, progress=False)
    _no_training_happened(out)


def test_student_of_another_teacher(tiny_student, text_file, tmp_path):
    other = build_llama(tmp_path / "other", seed=1)  # same shapes and tokenizer, other weights
    out = tmp_path / "o"
    with pytest.raises(KVConvertError, match="not converted from this teacher"):
        heal(tiny_student, other, layerwise_recipe(text_file), out, progress=False)
    _no_training_happened(out)


def test_teacher_with_other_shape(tiny_student, text_file, tmp_path):
    other = build_llama(tmp_path / "deeper", layers=3)
    with pytest.raises(KVConvertError, match="num_hidden_layers"):
        heal(tiny_student, other, layerwise_recipe(text_file), tmp_path / "o", progress=False)


def test_different_tokenizer(tiny_student, tiny_teacher, text_file, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (teacher / f).unlink()
    build_tokenizer(teacher, vocab_size=300)  # different merges and ids, same model weights
    out = tmp_path / "o"
    with pytest.raises(KVConvertError, match="tokenizers differ"):
        heal(tiny_student, teacher, layerwise_recipe(text_file), out, progress=False)
    _no_training_happened(out)


def test_data_too_short(tiny_student, tiny_teacher, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("A few words only. " * 20)
    out = tmp_path / "o"
    with pytest.raises(KVConvertError, match=r"heal_distill .*data too short"):
        heal(tiny_student, tiny_teacher, distill_recipe(short), out, progress=False)
    _no_training_happened(out)


def test_recipe_errors(tiny_student, tiny_teacher, text_file, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("heal_layerwise:\n  step: 3\n")
    with pytest.raises(KVConvertError, match=r"bad\.yaml.*unknown key 'heal_layerwise\.step'"):
        heal(tiny_student, tiny_teacher, bad, tmp_path / "o", progress=False)
    with pytest.raises(KVConvertError, match="nothing to heal"):
        heal(tiny_student, tiny_teacher, {"convert": {"rank": 8}}, tmp_path / "o", progress=False)
    with pytest.raises(KVConvertError, match="not a recipe file or preset"):
        heal(tiny_student, tiny_teacher, "layerwize", tmp_path / "o", progress=False)


def test_existing_output(tiny_student, tiny_teacher, text_file, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    with pytest.raises(OutputExistsError):
        heal(tiny_student, tiny_teacher, layerwise_recipe(text_file), out, progress=False)


def test_cli_reports_errors(tiny_student, tiny_teacher, tmp_path, capsys):
    from kvconvert.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("heal_distill:\n  tokenz: 3\n")
    with pytest.raises(SystemExit) as info:
        main(["heal", "--student", str(tiny_student), "--teacher", str(tiny_teacher), "--recipe", str(bad),
              "--out", str(tmp_path / "o")])
    assert info.value.code == 2
    assert "heal_distill.tokenz" in capsys.readouterr().err
