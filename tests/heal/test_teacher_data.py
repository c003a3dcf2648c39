"""`data: teacher`: the teacher writes the healing data (sampled, seeded, cached)."""

from __future__ import annotations

import pytest

from kvconvert.errors import KVConvertError
from kvconvert.heal.api import prepare_data, teacher_tokens_needed
from kvconvert.token_stream import first_windows
from kvconvert.heal.teacher_data import OPENINGS, sample_teacher_text, teacher_text_cache
from kvconvert.recipe import Recipe, heal


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCONVERT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_samples_are_seeded_cached_and_start_from_the_openings(tiny_teacher, home):
    text = sample_teacher_text(tiny_teacher, 200, seed=3, batch_size=4, new_tokens=32, progress=False)
    cache = teacher_text_cache(tiny_teacher, 200, 3)
    with open(cache, encoding="utf-8", newline="") as f:
        assert f.read() == text
    samples = text.split("\n\n")
    assert len(samples) >= 200 // 32
    assert all(s.startswith(OPENINGS[i % len(OPENINGS)]) for i, s in enumerate(samples))
    cache.unlink()  # regenerating from scratch gives the same text: the sampling is seeded
    assert sample_teacher_text(tiny_teacher, 200, seed=3, batch_size=4, new_tokens=32, progress=False) == text
    other = sample_teacher_text(tiny_teacher, 200, seed=4, batch_size=4, new_tokens=32, progress=False)
    assert other != text


def test_prepare_data_sizes_teacher_text_for_the_larger_stage(tiny_teacher, home):
    from transformers import AutoTokenizer

    recipe = Recipe.model_validate({
        "heal_layerwise": {"data": "teacher", "tokens": 256, "window": 64, "steps": 1},
        "heal_distill": {"data": "teacher", "tokens": 512, "seq_len": 64}})
    assert teacher_tokens_needed(recipe) == int(512 * 1.1) + 1
    data = prepare_data(AutoTokenizer.from_pretrained(str(tiny_teacher)), recipe, tiny_teacher)
    assert tuple(data.layerwise.shape) == (256 // 64 + 1, 64)
    assert tuple(first_windows(data.distill, 512 // 64).shape) == (512 // 64, 64)  # streamed
    assert data.info["layerwise"]["data"] == data.info["distill"]["data"] == "teacher"
    with pytest.raises(KVConvertError, match="needs the teacher"):
        prepare_data(AutoTokenizer.from_pretrained(str(tiny_teacher)), recipe)


def test_heal_on_teacher_data_runs_end_to_end(tiny_student, tiny_teacher, home, tmp_path):
    recipe = {"heal_layerwise": {"data": "teacher", "tokens": 256, "window": 64, "steps": 3, "lr": 0.01}}
    report = heal(tiny_student, tiny_teacher, recipe, tmp_path / "healed", progress=False)
    assert report["data"]["layerwise"]["data"] == "teacher"
    assert (tmp_path / "healed" / "config.json").is_file()


def test_teacher_writes_only_the_unique_tokens_the_epochs_need():
    # 10 windows of 64 tokens in all, each seen up to 4 times: ceil(10 / 4) = 3 unique windows
    recipe = Recipe.model_validate({"heal_distill": {"data": "teacher", "tokens": 640, "seq_len": 64, "max_epochs": 4}})
    assert teacher_tokens_needed(recipe) == int(3 * 64 * 1.1) + 1


def test_cache_key_separates_devices(tiny_teacher, home):
    # a GPU draws other random numbers for the same seed: its text must not pose as the CPU's
    cpu = teacher_text_cache(tiny_teacher, 200, 0)
    assert teacher_text_cache(tiny_teacher, 200, 0, "cpu") == cpu
    assert teacher_text_cache(tiny_teacher, 200, 0, "cuda") != cpu
    assert teacher_text_cache(tiny_teacher, 200, 0, "cuda:1") == teacher_text_cache(tiny_teacher, 200, 0, "cuda")
