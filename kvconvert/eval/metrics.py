"""Scoring functions: perplexity and token KL, LongBench v1's metrics (ported), RULER's string
match, passkey and NIAH.

LongBench's metrics are re-implemented here without its dependencies (rouge, fuzzywuzzy), with
the same results:
- qa_f1: token F1 after SQuAD normalization (lowercase, no punctuation, no articles).
- rouge_l: the `rouge` 1.0.1 package's ROUGE-L F (summary level, sentences split on ".",
  "exclusive" = unique-word sets), which LongBench calls; any error there scores 0, as in LongBench.
- classification, count, retrieval: LongBench's rules, including the quirk of
  classification_score that removes items from the list it is iterating over.
- code_sim: fuzzywuzzy's fuzz.ratio (pure-Python difflib path) of the first line of the
  prediction that has no comment or backtick, divided by 100.
All scores are floats in [0, 1]; LongBench reports 100 x the task mean.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter

from kvconvert.token_stats import window_sums  # the one NLL/KL sum (a floor module the engines use too)

# --------------------------------------------------------------------------- LongBench

_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalization as in LongBench: lowercase, drop punctuation, drop articles, squash spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction_tokens: list[str], truth_tokens: list[str]) -> float:
    """F1 of the multiset overlap of two token lists (0 when nothing is shared)."""
    common = Counter(prediction_tokens) & Counter(truth_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _lcs_words(reference: list[str], evaluated: list[str]) -> list[str]:
    """The longest common subsequence of two word lists, reconstructed with the `rouge` package's
    tie-break (move up when table[i-1][j] > table[i][j-1], else left), iteratively (no recursion
    limit). Which words end up in the LCS matters because ROUGE-L unions them as sets."""
    n, m = len(reference), len(evaluated)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        row, prev = table[i], table[i - 1]
        ref_word = reference[i - 1]
        for j in range(1, m + 1):
            if ref_word == evaluated[j - 1]:
                row[j] = prev[j - 1] + 1
            else:
                row[j] = max(prev[j], row[j - 1])
    words = []
    i, j = n, m
    while i > 0 and j > 0:
        if reference[i - 1] == evaluated[j - 1]:
            words.append(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words[::-1]


def _rouge_sentences(text: str) -> list[str]:
    """The `rouge` package's preprocessing: split on ".", squash whitespace, drop empty pieces."""
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def rouge_l_f(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F as computed by `rouge` 1.0.1 (Rouge().get_scores(...)["rouge-l"]["f"]).

    Summary-level LCS: for each reference sentence, the union (as a set of words) of its LCS
    with every predicted sentence; the new words it adds are summed; recall and precision divide
    by the number of unique words of the reference / prediction. Raises ValueError on empty input.
    """
    hyp, ref = _rouge_sentences(prediction), _rouge_sentences(ground_truth)
    if not hyp or not ref:
        raise ValueError("Collections must contain at least 1 sentence.")
    ref_unique = len({w for s in ref for w in s.split(" ")})
    hyp_unique = len({w for s in hyp for w in s.split(" ")})
    union: set[str] = set()
    overlap = 0
    for ref_sentence in ref:
        before = len(union)
        ref_words = ref_sentence.split(" ")
        for hyp_sentence in hyp:
            union |= set(_lcs_words(ref_words, hyp_sentence.split(" ")))
        overlap += len(union) - before
    recall = overlap / ref_unique
    precision = overlap / hyp_unique
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
    """LongBench's rouge_score: ROUGE-L F, 0 when the rouge computation raises (e.g. empty text)."""
    try:
        return rouge_l_f(prediction, ground_truth)
    except (ValueError, ZeroDivisionError):
        return 0.0


def classification_score(prediction: str, ground_truth: str, all_classes=None, **_) -> float:
    """LongBench's classification_score, verbatim semantics.

    Classes named in the prediction are collected; a class that is a substring of the true class
    (but not equal to it) is removed. LongBench removes while iterating over the same list, so
    the element right after a removed one is skipped; that is kept so scores match LongBench.
    """
    matches = [name for name in (all_classes or []) if name in prediction]
    for term in matches:  # mutating while iterating: LongBench's behaviour, kept on purpose
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    if ground_truth in matches:
        return 1.0 / len(matches)
    return 0.0


def _fraction_equal(numbers: list[str], wanted: str) -> float:
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == wanted) / len(numbers)


def count_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the integers in the prediction that equal the true count."""
    return _fraction_equal(re.findall(r"\d+", prediction), str(ground_truth))


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the integers in the prediction that equal the paragraph number in 'Paragraph N'."""
    wanted = re.findall(r"Paragraph (\d+)", ground_truth)[0]
    return _fraction_equal(re.findall(r"\d+", prediction), wanted)


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy.fuzz.ratio without python-Levenshtein: 100 if equal, 0 if either is empty,
    else round(100 * difflib.SequenceMatcher(None, a, b).ratio())."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return round(100 * difflib.SequenceMatcher(None, a, b).ratio())


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """LongBench's code_sim: the first prediction line without '`', '#' or '//', fuzz ratio / 100."""
    first = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            first = line
            break
    return fuzz_ratio(first, ground_truth) / 100


LONGBENCH_METRICS = {
    "qa_f1": qa_f1_score,
    "rouge": rouge_score,
    "classification": classification_score,
    "count": count_score,
    "retrieval": retrieval_score,
    "code_sim": code_sim_score,
}

# LongBench v1 (English + code): task -> metric, max new tokens (dataset2maxlen), category.
LONGBENCH_TASKS: dict[str, tuple[str, int, str]] = {
    "narrativeqa": ("qa_f1", 128, "single-doc QA"),
    "qasper": ("qa_f1", 128, "single-doc QA"),
    "multifieldqa_en": ("qa_f1", 64, "single-doc QA"),
    "hotpotqa": ("qa_f1", 32, "multi-doc QA"),
    "2wikimqa": ("qa_f1", 32, "multi-doc QA"),
    "musique": ("qa_f1", 32, "multi-doc QA"),
    "gov_report": ("rouge", 512, "summarization"),
    "qmsum": ("rouge", 512, "summarization"),
    "multi_news": ("rouge", 512, "summarization"),
    "trec": ("classification", 64, "few-shot"),
    "triviaqa": ("qa_f1", 32, "few-shot"),
    "samsum": ("rouge", 128, "few-shot"),
    "passage_count": ("count", 32, "synthetic"),
    "passage_retrieval_en": ("retrieval", 32, "synthetic"),
    "lcc": ("code_sim", 64, "code"),
    "repobench-p": ("code_sim", 64, "code"),
}
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum")  # LongBench scores only the first line there


def longbench_sample_score(task: str, prediction: str, answers: list[str], all_classes=None) -> float:
    """LongBench's per-sample score: max over the gold answers of the task's metric, in [0, 1]."""
    metric = LONGBENCH_METRICS[LONGBENCH_TASKS[task][0]]
    if task in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    return max((metric(prediction, truth, all_classes=all_classes) for truth in answers), default=0.0)


# --------------------------------------------------------------------------- synthetic tasks

def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's string_match_all: share of references found (case-insensitive substring)."""
    if not references:
        return 0.0
    text = prediction.lower()
    return sum(1.0 for ref in references if ref.lower() in text) / len(references)


def passkey_score(prediction: str, passkey: str) -> float:
    """1.0 if the first integer in the continuation is exactly the pass key, else 0.0."""
    found = re.search(r"\d+", prediction)
    return 1.0 if found is not None and found.group(0) == passkey else 0.0


def window_stats(source_logits: torch.Tensor, candidate_logits: torch.Tensor, ids: torch.Tensor) -> dict:
    """One window's cached perplexity record: float64 sums over its T-1 predictions (window_sums).

    logits: [T, V] fp32 from each model for ids [T]. Returns source_nll / candidate_nll = sum of
    -log p(next token), kl = sum of KL(source || candidate) and n_tokens.
    """
    source = window_sums(source_logits, ids)
    candidate = window_sums(candidate_logits, ids, source_logits)
    return {"source_nll": source.nll, "candidate_nll": candidate.nll, "kl": candidate.kl, "n_tokens": candidate.tokens}
