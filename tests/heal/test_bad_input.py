"""Bad inputs fail with one clear KVConvertError before any training starts."""

import shutil

import pytest

from kvconvert.errors import KVConvertError, OutputExistsError, UnsupportedModelError
from kvconvert.heal.api import state_dir_for
from kvconvert.recipe import heal

from heal_cases import build_llama, distill_recipe, layerwise_recipe, train_tokenizer


def _retokenized(teacher, tmp_path):
    """A copy of the teacher with another tokenizer: different merges and ids, same model weights."""
    copy = tmp_path / "teacher"
    shutil.copytree(teacher, copy)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (copy / f).unlink()
    train_tokenizer(copy, vocab_size=300)
    return copy


def _file(tmp_path, name: str, text: str):
    (tmp_path / name).write_text(text)
    return tmp_path / name


# case: (student, teacher, recipe) from (tiny_student, tiny_teacher, text_file, tmp_path), error, message
CASES = {
    # the teacher's own architecture heals (for its cache) by distillation; it has no converted block to reconstruct
    "layerwise-on-an-unconverted-student": (lambda s, t, text, tmp: (t, t, layerwise_recipe(text)),
                                            KVConvertError, "teacher's own architecture.*heal_distill alone"),
    "student-is-neither-mla-nor-the-teachers": (lambda s, t, text, tmp: (t, s, layerwise_recipe(text)),
                                                UnsupportedModelError, "not 'deepseek_v3'"),
    "student-of-another-teacher": (  # same shapes and tokenizer, other weights
        lambda s, t, text, tmp: (s, build_llama(tmp / "other", seed=1), layerwise_recipe(text)),
        KVConvertError, "not converted from this teacher"),
    "teacher-with-other-shape": (lambda s, t, text, tmp: (s, build_llama(tmp / "deeper", layers=3),
                                                          layerwise_recipe(text)),
                                 KVConvertError, "num_hidden_layers"),
    "different-tokenizer": (lambda s, t, text, tmp: (s, _retokenized(t, tmp), layerwise_recipe(text)),
                            KVConvertError, "tokenizers differ"),
    "data-too-short": (lambda s, t, text, tmp: (s, t, distill_recipe(_file(tmp, "short.txt", "A few words. " * 20))),
                       KVConvertError, r"heal_distill .*data too short"),
    "unknown-recipe-key": (lambda s, t, text, tmp: (s, t, _file(tmp, "bad.yaml", "heal_layerwise:\n  step: 3\n")),
                           KVConvertError, r"bad\.yaml.*unknown key 'heal_layerwise\.step'"),
    "nothing-to-heal": (lambda s, t, text, tmp: (s, t, {"convert": {"rank": 8}}), KVConvertError, "nothing to heal"),
    "unknown-preset": (lambda s, t, text, tmp: (s, t, "layerwize"), KVConvertError, "not a recipe file or preset"),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_before_any_training(case, tiny_student, tiny_teacher, text_file, tmp_path):
    make, error, match = CASES[case]
    out = tmp_path / "o"
    with pytest.raises(error, match=match):
        heal(*make(tiny_student, tiny_teacher, text_file, tmp_path), out, progress=False)
    assert not out.exists() and not state_dir_for(out).exists()


def test_existing_output(tiny_student, tiny_teacher, text_file, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    with pytest.raises(OutputExistsError):
        heal(tiny_student, tiny_teacher, layerwise_recipe(text_file), out, progress=False)
