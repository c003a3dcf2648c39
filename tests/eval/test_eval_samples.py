"""Sample generation: determinism, prompt lengths, needles really at the requested depth
(checked on the tokenizer's own offsets, independently of the builder), RULER and LongBench
inputs, bad data."""

import json
from pathlib import Path

import pytest

from kvconvert.errors import KVConvertError
from kvconvert.eval import haystack as H
from kvconvert.eval import longbench as LB


def needle_token_depth(tokenizer, sample_text: str, needle: str, head: str, tail: str) -> float:
    """Depth of `needle` measured with offset mappings: filler tokens before it / filler tokens."""
    enc = tokenizer(sample_text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    start = sample_text.index(needle)
    hay_start, hay_end = len(head), len(sample_text) - len(tail)
    needle_end = start + len(needle)

    def inside(a, b):
        return [i for i, (s, e) in enumerate(offsets) if s >= a and e <= b and e > s]

    before = len(inside(hay_start, start))
    filler = before + len(inside(needle_end, hay_end))
    return before / filler


@pytest.mark.parametrize("length", [256, 768])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_passkey_needle_at_depth_and_within_length(tiny_tokenizer, length, depth):
    sample = H.passkey_sample(tiny_tokenizer, length, depth, repeat=0, seed=7)
    assert len(sample.prompt_ids) <= length
    assert len(sample.prompt_ids) > length - 60  # filled: at most ~one filler paragraph short
    text = tiny_tokenizer.decode(sample.prompt_ids)
    line = H.passkey_line(sample.answers[0])
    assert text.count(line) == 1 and text.endswith(H.PASSKEY_QUESTION)
    measured = needle_token_depth(tiny_tokenizer, text, line, H.PASSKEY_INTRO, H.PASSKEY_QUESTION)
    unit = len(tiny_tokenizer(" " + H.PASSKEY_FILLER, add_special_tokens=False).input_ids)
    filler = len(sample.prompt_ids) - len(tiny_tokenizer(H.PASSKEY_INTRO + line + H.PASSKEY_QUESTION).input_ids)
    assert abs(measured - depth) <= unit / filler / 2 + 0.01  # within half a filler paragraph
    assert abs(sample.meta["needle_depth"] - measured) < 0.02


def test_passkey_deterministic_and_keys_differ(tiny_tokenizer):
    a = H.passkey_sample(tiny_tokenizer, 256, 0.5, 0, seed=7)
    b = H.passkey_sample(tiny_tokenizer, 256, 0.5, 0, seed=7)
    assert a.prompt_ids == b.prompt_ids and a.answers == b.answers and a.content_hash == b.content_hash
    keys = {H.passkey_sample(tiny_tokenizer, 256, d, r, seed=7).answers[0] for d in (0.0, 0.5) for r in (0, 1)}
    assert len(keys) == 4 and all(len(k) == 5 and k.isdigit() for k in keys)
    assert H.passkey_sample(tiny_tokenizer, 256, 0.5, 0, seed=8).answers != a.answers


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_niah_needle_at_depth(tiny_tokenizer, depth):
    sample = H.niah_sample(tiny_tokenizer, 1024, depth)
    assert len(sample.prompt_ids) <= 1024
    text = tiny_tokenizer.decode(sample.prompt_ids)
    measured = needle_token_depth(tiny_tokenizer, text, H.NIAH_NEEDLE, "", H.NIAH_QUESTION)
    longest_sentence = max(len(tiny_tokenizer(H.essay_unit(k)).input_ids) for k in range(60))
    assert abs(measured - depth) <= longest_sentence / 900 + 0.01
    assert sample.answers == H.NIAH_KEY_PHRASES


def test_build_haystack_rejects_bad_depth_and_tiny_length(tiny_tokenizer):
    with pytest.raises(KVConvertError, match="depth"):
        H.build_haystack(tiny_tokenizer, "", "?", lambda k: " x.", [(1.5, " needle.")], 100)
    with pytest.raises(KVConvertError, match="no room"):
        H.build_haystack(tiny_tokenizer, "a long head " * 20, "?", lambda k: " x.", [], 10)


@pytest.mark.parametrize("task", H.RULER_TASKS)
def test_ruler_samples_deterministic_answers_in_prompt(tiny_tokenizer, task):
    a = H.ruler_sample(tiny_tokenizer, task, 640, 0, seed=3)
    assert a.prompt_ids == H.ruler_sample(tiny_tokenizer, task, 640, 0, seed=3).prompt_ids
    assert a.prompt_ids != H.ruler_sample(tiny_tokenizer, task, 640, 1, seed=3).prompt_ids
    assert len(a.prompt_ids) <= 640
    text = tiny_tokenizer.decode(a.prompt_ids)
    for answer in a.answers:
        assert answer in text
    spec = H.RULER_NIAH_TASKS.get(task)
    if spec is not None:
        expected = spec.num_q * spec.num_v
        assert len(a.answers) == expected
        assert text.count("One of the special magic") >= max(spec.num_k, spec.num_q) * spec.num_v


def test_ruler_vt_chain_in_order(tiny_tokenizer):
    sample = H.ruler_vt_sample(tiny_tokenizer, 512, 0, seed=3)
    text = tiny_tokenizer.decode(sample.prompt_ids)
    names = sample.answers
    positions = [text.index(f"VAR {name} =") for name in names]
    assert positions == sorted(positions)
    value = text.split(f"VAR {names[0]} = ")[1].split()[0]
    assert f"assgined the value {value}, they are:" in text  # RULER's template, typo included


def test_ruler_multikey_queries_one_of_four_keys(tiny_tokenizer):
    sample = H.ruler_niah_sample(tiny_tokenizer, "niah_multikey_1", 640, 0, seed=3)
    text = tiny_tokenizer.decode(sample.prompt_ids)
    assert text.count("One of the special magic numbers for") == 4
    assert text.startswith("A special magic number is hidden")  # RULER's singular rewrite


# --------------------------------------------------------------------------- LongBench

def test_truncate_middle_hand_example():
    assert LB.truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert LB.truncate_middle(list(range(10)), 5) == [0, 1, 8, 9]  # LongBench keeps 2 * (5 // 2)
    assert LB.truncate_middle([1, 2, 3], 5) == [1, 2, 3]


def test_longbench_missing_data_errors_name_the_path(tmp_path):
    with pytest.raises(KVConvertError, match=str(tmp_path / "nope")):
        LB.load_longbench(tmp_path / "nope")
    (tmp_path / "lb").mkdir()
    with pytest.raises(KVConvertError, match="hotpotqa.jsonl"):
        LB.load_longbench(tmp_path / "lb", ("hotpotqa",))
    (tmp_path / "lb" / "hotpotqa.jsonl").write_text(json.dumps({"id": "x", "prompt": "raw text", "answers": ["a"]}))
    with pytest.raises(KVConvertError, match="LongBench template"):
        LB.load_longbench(tmp_path / "lb", ("hotpotqa",))
    (tmp_path / "lb" / "hotpotqa.jsonl").write_text('{"id": "x", "prompt": ')
    with pytest.raises(KVConvertError, match="not valid JSON"):
        LB.load_longbench(tmp_path / "lb", ("hotpotqa",))


def test_longbench_dir_override_by_env(monkeypatch, tmp_path):
    monkeypatch.setenv(LB.ENV_VAR, str(tmp_path))
    assert LB.default_longbench_dir() == tmp_path


def test_longbench_samples_truncated_with_budgets(tmp_path, tiny_tokenizer):
    prompt = ("Answer the question based on the given passages. Only give me the answer and do not output any "
              "other words.\n\nThe following are given passages.\n" + "Passage text. " * 400 + "\nAnswer:")
    rows = [{"id": f"hotpotqa-{i}", "prompt": prompt, "answers": ["x"]} for i in range(3)]
    (tmp_path / "hotpotqa.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "samsum.jsonl").write_text(json.dumps({"id": "samsum-0", "answers": ["y"], "prompt": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n" + "hi " * 50)}))
    data = LB.load_longbench(tmp_path, ("hotpotqa", "samsum"))
    samples = LB.longbench_samples(tiny_tokenizer, data, context=300, per_task=2, max_new_cap=None)
    assert [s.sample_id for s in samples] == ["hotpotqa-0", "hotpotqa-1", "samsum-0"]
    hotpot = samples[0]
    assert hotpot.max_new_tokens == 32 and len(hotpot.prompt_ids) == 300 - 32
    full = tiny_tokenizer(prompt).input_ids
    assert list(hotpot.prompt_ids) == full[:134] + full[-134:]  # head and tail kept
    samsum = samples[2]
    assert samsum.max_new_tokens == 128 and samsum.stop_ids == tuple(tiny_tokenizer.encode("\n")[-1:])
    capped = LB.longbench_samples(tiny_tokenizer, data, context=300, per_task=1, max_new_cap=8)
    assert [s.max_new_tokens for s in capped] == [8, 8]


def test_longbench_chat_template_as_pred_py(tmp_path, tiny_tokenizer):
    """An instruct model (a chat template) gets the truncated prompt wrapped in it, room left for the template's
    tokens; few-shot and code tasks keep the plain prompt; the reference answer starts the assistant turn."""
    import copy

    chat = copy.deepcopy(tiny_tokenizer)
    chat.chat_template = ("{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}"
                          "{% if add_generation_prompt %}\n<bot>\n{% endif %}")
    prompt = ("Answer the question based on the given passages. Only give me the answer and do not output any "
              "other words.\n\nThe following are given passages.\n" + "Passage text. " * 400 + "\nAnswer:")
    (tmp_path / "hotpotqa.jsonl").write_text(json.dumps({"id": "h", "prompt": prompt, "answers": ["Paris"]}))
    (tmp_path / "trec.jsonl").write_text(json.dumps({"id": "t", "answers": ["Date"], "all_classes": ["Date"],
                                                     "prompt": "Please determine the type of the question below. " * 3}))
    data = LB.load_longbench(tmp_path, ("hotpotqa", "trec"))
    hotpot, trec = LB.longbench_samples(chat, data, context=300, per_task=None, max_new_cap=None)
    before, after = LB.chat_wrapper(chat)
    assert len(hotpot.prompt_ids) == 300 - 32  # template tokens counted in the budget
    body = chat(prompt, add_special_tokens=False).input_ids
    half = (300 - 32 - len(before) - len(after)) // 2
    assert list(hotpot.prompt_ids) == before + body[:half] + body[-half:] + after
    assert hotpot.meta["chat"] and chat.decode(hotpot.reference_ids) == "Paris"  # no space after the turn's newline
    assert not trec.meta["chat"] and "<user>" not in chat.decode(trec.prompt_ids)  # pred.py: no chat on trec
    assert LB.chat_wrapper(tiny_tokenizer) is None  # a base model: the plain prompt
    plain = LB.longbench_samples(tiny_tokenizer, data, context=300, per_task=None, max_new_cap=None)[0]
    assert tiny_tokenizer.decode(plain.reference_ids) == " Paris"  # after "Answer:" a space


def test_longbench_task_at_the_floor_is_left_out_with_its_reason():
    from eval_fixtures import gen_records, make_report

    from kvconvert.eval.stats import estimate

    samples = {"longbench/trec": gen_records([0.6, 0.4], [0.2, 0.2]),
               "longbench/passage_count": gen_records([0.0, 0.0], [1.0, 0.0])}  # "improved" at the floor
    e = estimate(samples, "longbench_avg_drop")
    assert e.point == pytest.approx(30.0) and e.n == 2  # trec alone
    assert "source scores 0.0 points (< 5): at the floor" in e.left_out["longbench/passage_count"]
    report = make_report({"longbench/passage_count": samples["longbench/passage_count"]})
    from kvconvert.eval import gate as G

    row = G.evaluate(report, G.Policy.model_validate({"thresholds": {"longbench_avg_drop": 2}}))[0]
    assert row["status"] == "n/a" and row["reason"].startswith("every task left out: longbench/passage_count")


def test_packaged_longbench_mini_is_the_default(monkeypatch):
    """The default LongBench copy ships in the package (every user has it; tests/test_wheel.py checks
    an installed wheel): 16 tasks, the 187 samples its README lists, each task's rows in order."""
    from kvconvert.resources import longbench_mini_dir

    monkeypatch.delenv(LB.ENV_VAR, raising=False)
    folder = LB.default_longbench_dir()
    assert folder == longbench_mini_dir() and folder.parent == Path(LB.__file__).parent
    data = LB.load_longbench(folder)
    counts = {task: len(rows) for task, rows in data.items()}
    assert counts["lcc"] == 26 and counts["passage_count"] == 4 and sum(counts.values()) == 187
    assert [row["id"] for row in data["trec"]] == [f"trec-{i}" for i in range(8)] and data["trec"][0]["all_classes"]


def test_longbench_reads_jsonl_and_gzip_alike(tmp_path):
    """A --longbench-dir copy may hold <task>.jsonl or <task>.jsonl.gz; a broken .gz is named."""
    import gzip

    from kvconvert.resources import longbench_mini_dir

    packed = LB.load_longbench(longbench_mini_dir(), ("samsum", "lcc"))
    (tmp_path / "samsum.jsonl").write_text("\n".join(json.dumps(r) for r in packed["samsum"]) + "\n")
    (tmp_path / "lcc.jsonl.gz").write_bytes(gzip.compress("\n".join(json.dumps(r) for r in packed["lcc"]).encode()))
    assert LB.load_longbench(tmp_path, ("samsum", "lcc")) == packed
    (tmp_path / "lcc.jsonl.gz").write_bytes(gzip.compress(b'{"id": 1}')[:-6])  # torn
    with pytest.raises(KVConvertError, match="lcc.jsonl.gz: not a readable gzip file"):
        LB.load_longbench(tmp_path, ("lcc",))


def test_quick_suite_asks_passkey_and_niah_at_4096_tokens(tiny_tokenizer, tmp_path):
    """The quick suite's long grid: a passkey and a NIAH prompt of 4096 tokens at half depth, beside the 512-token
    grid; a model whose context cannot hold them drops them with a note instead."""
    import dataclasses
    from types import SimpleNamespace

    from kvconvert.eval.suites import SUITES
    from kvconvert.eval.validate import ValidateOptions, ValidateRun, build_samples

    spec = dataclasses.replace(SUITES["quick"], longbench=False)
    run = ValidateRun("s", "c", tmp_path, ValidateOptions(), spec)

    def lengths(context: int) -> dict[str, list[int]]:
        samples = build_samples(SimpleNamespace(tokenizer=tiny_tokenizer, context=context), spec, run, {})
        out = {}
        for s in samples:
            out.setdefault(s.task, []).append(s.meta["length"])
        return out

    assert lengths(8192) == {"passkey": [512, 512, 512, 4096], "niah": [512, 512, 512, 4096]}
    assert lengths(2048) == {"passkey": [512, 512, 512], "niah": [512, 512, 512]}
    assert any("long-context passkey and NIAH: length 4096" in n for n in run.notes)
