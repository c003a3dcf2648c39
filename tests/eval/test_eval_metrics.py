"""LongBench / RULER / passkey scoring against hand-worked examples."""

import pytest

from kvconvert.eval import metrics as M


def test_normalize_answer_lower_punct_articles_spaces():
    assert M.normalize_answer("  The Eiffel-Tower, in  a PARIS!") == "eiffeltower in paris"


def test_qa_f1_hand_worked():
    # pred tokens: eiffel tower paris (3); gold: eiffel tower (2); overlap 2 -> P 2/3, R 1, F1 0.8
    assert M.qa_f1_score("The Eiffel Tower, Paris!", "eiffel tower") == pytest.approx(0.8)
    assert M.qa_f1_score("nothing shared", "eiffel tower") == 0.0
    # multiset overlap: "a a b" vs "a b b" after normalization drops "a" (article) -> "b" vs "b b"
    # P = 1/1, R = 1/2 -> 2/3
    assert M.qa_f1_score("a a b", "a b b") == pytest.approx(2 / 3)


@pytest.mark.parametrize("prediction, reference, expected", [
    # ref words {the, cat, is, on, mat} = 5 unique; hyp {the, cat, sat, on, mat} = 5 unique;
    # LCS = "the cat on the mat" -> unique words {the, cat, on, mat} = 4 -> R = P = 0.8
    ("the cat sat on the mat", "the cat is on the mat", 0.8),
    # summary level: hyp sentences "a b", "c d"; ref "a c", "b d". For "a c": LCS with "a b" = {a}, with
    # "c d" = {c} -> 2 new; for "b d": {b} and {d} -> 2 new; overlap 4 of 4 unique words each side -> F = 1.
    ("a b. c d", "a c. b d", 1.0),
    ("the the the", "the", 1.0),  # unique-word ("exclusive") counting: repeats add no precision or recall
    # tie-break: x = ref "a b", y = hyp "b a": both "a" and "b" are LCS of length 1; the rouge package
    # walks left on ties and ends on "a": one unique word overlaps -> R = P = 1/2.
    ("b a", "a b", 0.5),
    ("", "a summary.", 0.0),  # empty prediction scores 0, like LongBench
    ("...", "a summary.", 0.0),  # only dots: no sentence left
])
def test_rouge_l_hand_worked(prediction, reference, expected):
    assert M.rouge_score(prediction, reference) == pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize("prediction, truth, classes, expected", [
    ("Date", "Date", ["Food", "Date", "Order, rank", "Speed"], 1.0),
    ("Date and Food", "Date", ["Food", "Date", "Order, rank", "Speed"], 0.5),
    ("Speed", "Date", ["Food", "Date", "Order, rank", "Speed"], 0.0),
    # matches: ["Other location", "location", "Other"]; "location" is removed while iterating,
    # which skips "Other" (LongBench's behaviour): 1 / 2 instead of 1 / 1.
    ("Other location", "Other location", ["Other location", "location", "Other", "City"], 0.5),
])
def test_classification_score(prediction, truth, classes, expected):
    assert M.classification_score(prediction, truth, all_classes=classes) == expected


def test_count_and_retrieval():
    assert M.count_score("There are 12 unique paragraphs, 12 in total out of 30", "12") == pytest.approx(2 / 3)
    assert M.count_score("no digits", "12") == 0.0
    assert M.retrieval_score("Paragraph 7", "Paragraph 7") == 1.0
    assert M.retrieval_score("Paragraph 3 or Paragraph 7", "Paragraph 7") == 0.5
    assert M.retrieval_score("none", "Paragraph 7") == 0.0


def test_fuzz_ratio_and_code_sim():
    assert M.fuzz_ratio("abc", "abc") == 100
    assert M.fuzz_ratio("", "abc") == 0
    # "    return x" (12) + "+" + "1" match: 2 * 14 / (16 + 14) = 0.9333 -> 93
    assert M.fuzz_ratio("    return x + 1", "    return x+1") == 93
    pred = "\n# a comment\n    return x + 1\nprint(y)"
    assert M.code_sim_score(pred, "    return x+1") == pytest.approx(0.93)
    assert M.code_sim_score("# only\n// comments\n```", "x = 1") == 0.0


def test_longbench_sample_score_first_line_and_max_over_answers():
    # triviaqa scores only the first line; the best of the gold answers counts
    assert M.longbench_sample_score("triviaqa", "\nParis\nand other words", ["London", "Paris"]) == 1.0
    # hotpotqa scores the whole prediction: "paris and more" vs "paris": P 1/3, R 1 -> F1 0.5
    assert M.longbench_sample_score("hotpotqa", "Paris\nand more", ["Paris"]) == pytest.approx(0.5)
    assert M.longbench_sample_score("trec", "Date\nFood", ["Date"], all_classes=["Food", "Date"]) == 1.0


def test_longbench_task_table_matches_dataset2maxlen():
    assert len(M.LONGBENCH_TASKS) == 16
    assert M.LONGBENCH_TASKS["gov_report"][:2] == ("rouge", 512)
    assert M.LONGBENCH_TASKS["hotpotqa"][:2] == ("qa_f1", 32)
    assert M.LONGBENCH_TASKS["lcc"][:2] == ("code_sim", 64)
    assert M.LONGBENCH_TASKS["samsum"][:2] == ("rouge", 128)


def test_string_match_all_and_passkey():
    assert M.string_match_all("numbers are 123 and 456", ["123", "789"]) == 0.5
    assert M.string_match_all("ABC", ["abc"]) == 1.0
    assert M.passkey_score(" 12345. Remember", "12345") == 1.0
    assert M.passkey_score("The key is 12345", "12345") == 1.0
    assert M.passkey_score("123456", "12345") == 0.0  # the number must match exactly
    assert M.passkey_score("no number", "12345") == 0.0
