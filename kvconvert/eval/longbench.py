"""LongBench-mini: 187 real LongBench v1 samples (16 English/code tasks), shipped in the package.

The default copy is kvconvert/eval/longbench-mini (MIT-licensed LongBench via MiniLongBench; its
README states source and license), found with importlib.resources (kvconvert.resources), so every
user's validation runs LongBench; --longbench-dir / $KVCONVERT_LONGBENCH_DIR name another copy.

Files: <dir>/<task>.jsonl or <task>.jsonl.gz with fields task, id, prompt (LongBench's dataset2prompt template
already applied, not truncated), answers (list), all_classes (trec only). Prompts are truncated
in the middle to fit the context, as LongBench's pred.py does; here the cut is made on the token
ids (first half + last half) instead of decoding both halves and re-tokenizing, so source and
candidate get exactly the same ids. A model with a chat template (an instruct model) gets its prompt wrapped
in it, as pred.py's build_chat does, except on the few-shot and code tasks (NO_CHAT_TASKS), where pred.py keeps
the plain completion prompt; the truncation leaves room for the template's tokens. Generation is greedy with
LongBench's dataset2maxlen budget; samsum also stops at a newline but must produce one token first, as pred.py's
min_length does. Each sample also carries its first gold answer as reference ids (answer likelihood).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from kvconvert.errors import KVConvertError
from kvconvert.eval.haystack import encode, reference_ids
from kvconvert.eval.metrics import LONGBENCH_TASKS
from kvconvert.eval.samples import GenSample

ENV_VAR = "KVCONVERT_LONGBENCH_DIR"

# The instruction each LongBench v1 template (dataset2prompt) opens with; a prompt that starts
# with none of them is not a templated LongBench prompt. (MiniLongBench applies the multi-doc QA
# template to qasper, so any task may open with any of these.)
TEMPLATE_OPENINGS = (
    "You are given a story, which can be either a novel or a movie script, and a question.",
    "You are given a scientific article and a question.",
    "Read the following text and answer briefly.",
    "Answer the question based on the given passages.",
    "You are given a report by a government agency.",
    "You are given a meeting transcript and a query",
    "You are given several news passages.",
    "Please determine the type of the question below.",
    "Answer the question based on the given passage.",
    "Summarize the dialogue into a few short sentences.",
    "There are some paragraphs below sourced from Wikipedia.",
    "Here are 30 paragraphs from Wikipedia, along with an abstract.",
    "Please complete the code given below.",
)


def default_longbench_dir() -> Path:
    """$KVCONVERT_LONGBENCH_DIR, else the copy shipped in the package. A package without its copy
    (a broken install) is an error here, never a skipped LongBench."""
    from kvconvert.resources import longbench_mini_dir

    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    folder = longbench_mini_dir()
    if not folder.is_dir():
        raise KVConvertError(f"this kvconvert install lacks its LongBench-mini data ({folder}); reinstall kvconvert, "
                             f"or pass --longbench-dir DIR / set {ENV_VAR}")
    return folder


def task_file(folder: Path, task: str) -> Path | None:
    """<task>.jsonl, else <task>.jsonl.gz (the packaged copy's form), else None."""
    for name in (f"{task}.jsonl", f"{task}.jsonl.gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _read_lines(path: Path) -> list[str]:
    if path.suffix == ".gz":
        try:
            return gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
        except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError; EOFError: a truncated file
            raise KVConvertError(f"{path}: not a readable gzip file ({exc}); restore the data folder") from None
    return path.read_text(encoding="utf-8").splitlines()


def longbench_files(folder: Path, tasks: tuple[str, ...] | None = None) -> dict[str, Path]:
    """task -> its data file in `folder` (names only, nothing read: validate checks this before any model loads).
    A missing folder and a folder without a task's file are refused alike (KVConvertError)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise KVConvertError(
            f"LongBench-mini data not found at {folder}; pass --longbench-dir DIR or set {ENV_VAR}")
    files = {}
    for task in tasks or tuple(LONGBENCH_TASKS):
        if task not in LONGBENCH_TASKS:
            raise KVConvertError(f"unknown LongBench task {task!r}; known: {', '.join(LONGBENCH_TASKS)}")
        files[task] = task_file(folder, task)
        if files[task] is None:
            raise KVConvertError(f"{folder / task}.jsonl(.gz): LongBench-mini task file missing; restore the data "
                                 f"folder {folder}")
    return files


def load_longbench(folder: Path, tasks: tuple[str, ...] | None = None) -> dict[str, list[dict]]:
    """task -> rows, in file order. Missing folder/file or malformed rows -> KVConvertError."""
    out: dict[str, list[dict]] = {}
    for task, path in longbench_files(folder, tasks).items():
        out[task] = [_check_row(path, i, line) for i, line in enumerate(_read_lines(path)) if line.strip()]
        if not out[task]:
            raise KVConvertError(f"{path}: no samples")
    return out


def _check_row(path: Path, index: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise KVConvertError(f"{path}:{index + 1}: not valid JSON ({exc.msg})") from None
    missing = [k for k in ("id", "prompt", "answers") if k not in row]
    if missing:
        raise KVConvertError(f"{path}:{index + 1}: missing field(s) {', '.join(missing)}")
    if not isinstance(row["answers"], list) or not row["answers"]:
        raise KVConvertError(f"{path}:{index + 1}: 'answers' must be a non-empty list")
    if not row["prompt"].startswith(TEMPLATE_OPENINGS):
        raise KVConvertError(f"{path}:{index + 1}: prompt does not start with a LongBench template; "
                             "the data must have dataset2prompt applied")
    return row


def truncate_middle(ids: list[int], max_len: int) -> list[int]:
    """LongBench's middle truncation on token ids: keep the first and last max_len // 2."""
    if len(ids) <= max_len:
        return list(ids)
    half = max_len // 2
    return list(ids[:half]) + list(ids[-half:])


def reference_text(prompt: str, answer: str) -> str:
    """The gold answer as the prompt's continuation: after "Answer:" a space, after a newline nothing."""
    return answer if not prompt or prompt[-1].isspace() else " " + answer


# LongBench's pred.py builds a chat prompt for chat models except on these tasks (few-shot and code: the
# prompt is a completion the model continues as is).
NO_CHAT_TASKS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")


def chat_wrapper(tokenizer) -> tuple[list[int], list[int]] | None:
    """The token ids before and after a user message in the tokenizer's chat template (generation prompt
    included), or None when it has no template (a base model: LongBench's plain prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\x00LONGBENCH_PROMPT\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = text.split(marker)
    return (tokenizer(before, add_special_tokens=False).input_ids, tokenizer(after, add_special_tokens=False).input_ids)


def longbench_samples(tokenizer, rows_by_task: dict[str, list[dict]], context: int, per_task: int | None,
                      max_new_cap: int | None) -> list[GenSample]:
    """Samples for every task, by LongBench's pred.py: the prompt truncated in the middle to what the context
    leaves after the task's budget (dataset2maxlen, capped at max_new_cap when given) and the chat template's
    own tokens, then wrapped in the chat template (chat models, tasks outside NO_CHAT_TASKS); the first
    `per_task` rows of each task (all if None)."""
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1:]
    chat = chat_wrapper(tokenizer)
    samples = []
    for task, rows in rows_by_task.items():
        _, max_new, category = LONGBENCH_TASKS[task]
        if max_new_cap is not None:
            max_new = min(max_new, max_new_cap)
        wrap = chat if chat is not None and task not in NO_CHAT_TASKS else None
        budget = context - max_new - (len(wrap[0]) + len(wrap[1]) if wrap else 0)
        if budget < 64:
            raise KVConvertError(f"LongBench context {context} leaves {budget} prompt tokens for {task} "
                                 f"({max_new} new tokens); use a longer one")
        for row in rows[:per_task]:
            # a chat prompt's special tokens come from the template; a plain one gets the tokenizer's (BOS)
            text = row["prompt"]
            ids = tokenizer(text, add_special_tokens=False).input_ids if wrap else encode(tokenizer, text)
            prompt = truncate_middle(ids, budget)
            if wrap is not None:
                prompt = wrap[0] + prompt + wrap[1]
            ends = "\n" if wrap is not None else row["prompt"]  # the assistant turn starts on a new line
            samples.append(GenSample(
                f"longbench/{task}", str(row["id"]), tuple(prompt), max_new, tuple(row["answers"]),
                stop_ids=tuple(newline) if task == "samsum" else (),
                min_new_tokens=1 if task == "samsum" else 0,
                reference_ids=reference_ids(tokenizer, reference_text(ends, row["answers"][0]), max_new),
                meta={"task": task, "category": category, "tokens": len(prompt), "full_tokens": len(ids),
                      "chat": wrap is not None, "all_classes": row.get("all_classes")}))
    return samples
