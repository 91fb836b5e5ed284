"""Tests for gspo_lightning.rewards.math and gspo_lightning.rewards.shaping."""

from __future__ import annotations

import json
import sys
import threading
from fractions import Fraction
from pathlib import Path

import pytest

from gspo_lightning.rewards.math import (
    answers_match,
    exact_match,
    extract_final_answer,
    extract_reference_answer,
    math_accuracy,
    parse_number,
)
from gspo_lightning.rewards.shaping import format_reward, length_penalty

GSM8K_TRAIN = Path(__file__).resolve().parents[1] / "gspo_lightning" / "data" / "datasets" / "gsm8k" / "train.jsonl"


def score(completion, answer, **kwargs) -> float:
    """math_accuracy on a single (completion, answer) pair."""
    return math_accuracy(["prompt"], [completion], [answer], **kwargs)[0]


# --------------------------------------------------------------------------- GSM8K data


@pytest.fixture(scope="module")
def gsm8k_solutions() -> list[str]:
    with GSM8K_TRAIN.open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert rows and all("question" in r and "answer" in r for r in rows)
    return [r["answer"] for r in rows]


def _bump_final_number(solution: str) -> str:
    """The solution with its ``#### N`` replaced by ``#### N+1``."""
    head, sep, final = solution.rpartition("####")
    assert sep, solution
    value = int(final.strip().replace(",", ""))
    return f"{head}#### {value + 1}"


def test_gsm8k_every_reference_solution_scores_itself_correct(gsm8k_solutions):
    scores = math_accuracy([""] * len(gsm8k_solutions), gsm8k_solutions, gsm8k_solutions)
    wrong = [s for s, x in zip(gsm8k_solutions, scores) if x != 1.0]
    assert not wrong, f"{len(wrong)} solutions not matched, e.g. {wrong[:3]}"


def test_gsm8k_changed_final_number_scores_wrong(gsm8k_solutions):
    mutated = [_bump_final_number(s) for s in gsm8k_solutions]
    scores = math_accuracy([""] * len(mutated), mutated, gsm8k_solutions)
    right = [m for m, x in zip(mutated, scores) if x != 0.0]
    assert not right, f"{len(right)} mutated solutions still scored correct, e.g. {right[:3]}"


def test_gsm8k_bare_final_answer_matches_solution(gsm8k_solutions):
    """A model answering only 'The answer is N' against the full solution as reference,
    including the thousands-comma answers ('#### 1,080') written without commas."""
    finals = [s.rpartition("####")[2].strip() for s in gsm8k_solutions]
    assert any("," in f for f in finals)  # the data has comma-formatted answers
    completions = [f"So the total is {f.replace(',', '')}. The answer is {f}." for f in finals]
    scores = math_accuracy([""] * len(finals), completions, gsm8k_solutions)
    assert all(x == 1.0 for x in scores)


def test_gsm8k_negative_answers_present_and_matched(gsm8k_solutions):
    negatives = [s for s in gsm8k_solutions if s.rpartition("####")[2].strip().startswith("-")]
    assert negatives
    assert math_accuracy([""] * len(negatives), negatives, negatives) == [1.0] * len(negatives)


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize(
    "reference, expected",
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72"),
        ("blah\n#### 1,080", "1,080"),
        ("#### -5\n", "-5"),
        ("72", "72"),
        ("  1/2 ", "1/2"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("The result is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        (72, "72"),
        ("", None),
        ("   ", None),
        (None, None),
    ],
)
def test_extract_reference_answer(reference, expected):
    assert extract_reference_answer(reference) == expected


# --------------------------------------------------------------------------- final answer


@pytest.mark.parametrize(
    "completion, expected",
    [
        # #### N
        ("First 2+2=4.\n#### 4", "4"),
        ("#### 7\nQuestion: something else with 9", "7"),
        ("#### 1,080 dollars", "1,080 dollars"),
        # \boxed{...}, nested braces, last one wins
        ("So the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("$\\boxed{\\dfrac{3}{4}}$", "\\dfrac{3}{4}"),
        ("\\boxed{\\left\\{1, 2\\right\\}}", "\\left\\{1, 2\\right\\}"),
        ("\\boxed 7", "7"),
        ("\\fbox{5}", "5"),
        ("unbalanced \\boxed{3 and then 8", "8"),  # truncated box: last number
        # The answer is N
        ("She has 3 apples. The answer is 18.", "18"),
        ("The final answer is: $18.00.", "$18.00"),
        ("the answer is 1,080 dollars.\nQ: next one has 5", "1,080 dollars"),
        ("The answer is -3", "-3"),
        ("The answer is \\(\\frac{3}{4}\\).", "\\(\\frac{3}{4}\\)"),
        ("The answer is B.", "B"),
        # Answer: N
        ("Reasoning 1 2 3\nAnswer: 12", "12"),
        ("Final Answer: -0.5", "-0.5"),
        # A: N
        ("Q: what is 2+3? A: 5", "5"),
        # last number fallback
        ("Natalia sold 48/2 = 24 clips in May, 72 in total.", "72"),
        ("It drops from 10 to -4", "-4"),
        ("1,234,567 people", "1,234,567"),
        ("A: Natalia sold 48/2 = 24 and then 72 total", "72"),
        # no answer
        ("no numbers here", None),
        ("", None),
        ("   \n ", None),
        (None, None),
    ],
)
def test_extract_final_answer(completion, expected):
    assert extract_final_answer(completion) == expected


def test_extract_final_answer_priority():
    # '####' beats \boxed beats 'The answer is' beats 'Answer:' beats 'A:'
    assert extract_final_answer("\\boxed{1}\n#### 2") == "2"
    assert extract_final_answer("The answer is 1. \\boxed{2}") == "2"
    assert extract_final_answer("Answer: 1. The answer is 2.") == "2"
    assert extract_final_answer("A: 1\nAnswer: 2") == "2"


def test_extract_final_answer_conversational_completion():
    messages = [{"role": "assistant", "content": "The answer is 9."}]
    assert extract_final_answer(messages) == "9"
    assert score(messages, "9") == 1.0


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    "text, value",
    [
        ("72", Fraction(72)),
        ("1,080", Fraction(1080)),
        ("1,234,567.5", Fraction(2469135, 2)),
        ("$18", Fraction(18)),
        ("\\$18.00", Fraction(18)),
        ("25%", Fraction(25)),
        ("25\\%", Fraction(25)),
        ("72.0", Fraction(72)),
        ("72.00", Fraction(72)),
        ("72.", Fraction(72)),
        ("-5", Fraction(-5)),
        ("(-5)", Fraction(-5)),
        ("0.5", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{3}{4}", Fraction(3, 4)),
        ("\\tfrac{3}{4}", Fraction(3, 4)),
        ("\\frac34", Fraction(3, 4)),
        ("-\\frac{3}{4}", Fraction(-3, 4)),
        ("\\frac{-3}{4}", Fraction(-3, 4)),
        ("$\\frac{1}{2}$", Fraction(1, 2)),
        ("18 dollars", Fraction(18)),
        ("5\\text{ cm}", Fraction(5)),
        ("1{,}000", Fraction(1000)),
        ("1/0", None),
        ("2x", None),
        ("1,2", None),  # not a thousands separator
        ("abc", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


# --------------------------------------------------------------------------- matching


@pytest.mark.parametrize(
    "predicted, reference",
    [
        ("72", "72"),
        ("1080", "1,080"),
        ("1,080", "1080"),
        ("$18", "18"),
        ("18.00", "18"),
        ("18.0", "18"),
        ("18.", "18"),
        ("25%", "25"),
        ("3/4", "0.75"),
        ("\\frac{3}{4}", "3/4"),
        ("\\dfrac{1}{2}", "0.5"),
        ("-\\frac{1}{2}", "-0.5"),
        ("-7", "-7"),
        ("B", "B"),
        ("(1, 2)", "(1,2)"),
    ],
)
def test_answers_match(predicted, reference):
    assert answers_match(predicted, reference)


@pytest.mark.parametrize(
    "predicted, reference",
    [
        ("72", "73"),
        ("-7", "7"),
        ("0.33", "1/3"),
        ("2x", "2"),
        ("B", "C"),
        (None, "1"),
        ("1", None),
        ("", ""),
    ],
)
def test_answers_do_not_match(predicted, reference):
    assert not answers_match(predicted, reference)


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        # each answer format
        ("Some work.\n#### 72", "#### 72", 1.0),
        ("Some work.\n#### 72", "72", 1.0),
        ("so \\boxed{72}", "72", 1.0),
        ("The answer is 72.", "He sold <<48+24=72>>72.\n#### 72", 1.0),
        ("Answer: 72", "72", 1.0),
        ("A: 72", "72", 1.0),
        ("48 + 24 = 72", "72", 1.0),
        ("48 + 24 = 72", "73", 0.0),
        # number normalization
        ("The answer is $1,080.00.", "#### 1,080", 1.0),
        ("The answer is 1080", "#### 1,080", 1.0),
        ("The answer is 50%.", "50", 1.0),
        ("\\boxed{18\\text{ dollars}}", "18", 1.0),
        # fractions
        ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
        ("The answer is 3/4.", "\\frac{3}{4}", 1.0),
        ("The answer is 3/4.", "\\frac{4}{3}", 0.0),
        # boxed with nested braces
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{2}}{2}", 0.0),
        # negatives
        ("The temperature drops to -4", "#### -4", 1.0),
        ("The answer is -4.", "4", 0.0),
        ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
        # garbage
        (None, "72", 0.0),
        ("", "72", 0.0),
        ("   ", "72", 0.0),
        ("no idea", "72", 0.0),
        ("\\boxed{", "72", 0.0),
        # a reference without an answer: unscored (counted), not 0
        ("72", None, None),
        ("72", "", None),
        ("72", "   ", None),
        (12345, "72", 0.0),
        ({"weird": "object"}, "72", 0.0),
    ],
)
def test_math_accuracy_cases(completion, answer, expected):
    assert score(completion, answer) == expected


def test_math_accuracy_batch_and_extra_columns():
    out = math_accuracy(
        ["p1", "p2", "p3"],
        ["#### 1", "The answer is 3", None],
        ["1", "2", "3"],
        question=["q1", "q2", "q3"],
        some_unknown_column=[0, 1, 2],
    )
    assert out == [1.0, 0.0, 0.0]
    assert all(isinstance(x, float) for x in out)


def test_math_accuracy_length_mismatch():
    with pytest.raises(ValueError, match=r"3 completions.*2 answers"):
        math_accuracy(["p"] * 3, ["1", "2", "3"], ["1", "2"])


# --------------------------------------------------------------------------- math-verify


def test_latex_equivalence_with_math_verify():
    pytest.importorskip("math_verify")
    assert score("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}") == 1.0
    assert score("\\boxed{(x+1)^2}", "x^2+2x+1") == 1.0
    assert score("\\boxed{\\frac{1}{\\sqrt{3}}}", "\\frac{\\sqrt{2}}{2}") == 0.0


def test_latex_equivalence_in_a_thread():
    """math-verify's signal-based timeout must not break rewards computed off the main thread."""
    pytest.importorskip("math_verify")
    result = []
    t = threading.Thread(
        target=lambda: result.append(score("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}"))
    )
    t.start()
    t.join()
    assert result == [1.0]


def test_unscorable_samples_are_counted_and_each_kind_printed_once(monkeypatch, capsys):
    from gspo_lightning.rewards import math as math_rewards

    math_accuracy.pop_failures()
    assert math_accuracy(["p"] * 3, ["#### 1", "#### 2", "#### 3"], ["1", "", None]) == [1.0, None, None]
    assert math_accuracy.pop_failures().count == 2 and math_accuracy.pop_failures().count == 0
    assert capsys.readouterr().err.count("holds no answer to compare with; fix the row") <= 1  # once per process

    def broken(*args, **kwargs):
        raise RuntimeError("sympy blew up")

    pytest.importorskip("math_verify")
    monkeypatch.setattr("math_verify.verify", broken)
    got = math_accuracy(["p"] * 2, ["\\boxed{\\frac{1}{\\sqrt{2}}}", "#### 5"], ["\\frac{\\sqrt{2}}{2}", "5"])
    assert got == [None, 1.0] and math_accuracy.pop_failures().count == 1
    assert "math-verify could not compare" in capsys.readouterr().err
    assert math_rewards.FAILURES.pop().count == 0


def test_without_math_verify_numeric_comparison_still_works(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    assert score("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert score("#### 1,080", "1080") == 1.0
    assert score("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}") == 0.0  # no symbolic check


# --------------------------------------------------------------------------- exact_match


def test_exact_match():
    out = exact_match(
        ["p"] * 6,
        ["  hello   world \n", "hello world", "Hello world", None, "72", ""],
        ["hello world", "hello\tworld", "hello world", "x", 72, ""],
        extra=[1] * 6,
    )
    assert out == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_exact_match_length_mismatch():
    with pytest.raises(ValueError, match=r"1 completions.*2 answers"):
        exact_match(["p"], ["a"], ["a", "b"])


# --------------------------------------------------------------------------- format_reward


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>reasoning</think><answer>42</answer>", 1.0),
        ("  <think>multi\nline</think>\n\n<answer>42</answer>\n", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("<think>r</think><answer>42</answer> trailing", 0.0),
        ("preamble <think>r</think><answer>42</answer>", 0.0),
        ("<answer>42</answer>", 0.0),
        ("<think>r</think>", 0.0),
        ("", 0.0),
        (None, 0.0),
    ],
)
def test_format_reward_default_pattern(completion, expected):
    assert format_reward(["p"], [completion], question=["q"]) == [expected]


def test_format_reward_custom_pattern_and_bad_pattern():
    pattern = r"(?s).*\\boxed\{.+\}"
    assert format_reward(["p", "p"], ["so \\boxed{3}", "so 3"], pattern=pattern) == [1.0, 0.0]
    with pytest.raises(ValueError, match="invalid regex"):
        format_reward(["p"], ["x"], pattern="(unclosed")


# --------------------------------------------------------------------------- length_penalty


def test_length_penalty_zones_in_characters():
    # max_length=10, buffer=4: 0 up to 6, linear in (6, 10], -1 above 10
    completions = ["a" * n for n in (0, 5, 6, 7, 8, 10, 11, 100)]
    out = length_penalty(["p"] * len(completions), completions, max_length=10, buffer=4)
    assert out == pytest.approx([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])


def test_length_penalty_uses_token_lengths_when_given():
    completions = ["short", "short", "short"]  # 5 characters each: no penalty by characters
    assert length_penalty(["p"] * 3, completions, max_length=100, buffer=20) == [0.0] * 3
    out = length_penalty(
        ["p"] * 3, completions, max_length=100, buffer=20, completion_lengths=[80, 90, 101]
    )
    assert out == pytest.approx([0.0, -0.5, -1.0])


def test_length_penalty_buffer_equal_to_max_length_and_extra_columns():
    out = length_penalty(["p"] * 2, ["ab", None], max_length=4, buffer=4, answer=["1", "2"])
    assert out == pytest.approx([-0.5, 0.0])


@pytest.mark.parametrize(
    "max_length, buffer, match",
    [
        (10, 0, "buffer must be a positive int"),
        (10, -1, "buffer must be a positive int"),
        (10, 11, r"buffer \(11\) must not exceed max_length \(10\)"),
        (0, 1, "max_length must be a positive int"),
        (10.5, 2, "max_length must be a positive int"),
    ],
)
def test_length_penalty_bad_arguments(max_length, buffer, match):
    with pytest.raises(ValueError, match=match):
        length_penalty(["p"], ["x"], max_length=max_length, buffer=buffer)


def test_length_penalty_lengths_mismatch():
    with pytest.raises(ValueError, match=r"2 completions but 1 completion_lengths"):
        length_penalty(["p"] * 2, ["a", "b"], max_length=10, buffer=2, completion_lengths=[3])


def test_a_bug_in_scoring_raises_instead_of_scoring_zero(monkeypatch):
    """No silent zeros: a completion without an answer scores 0, but an exception inside the scoring
    (an extraction bug) reaches the run's reward handling, which stops with a checkpoint or, with
    on_reward_error: zero, scores 0 and counts it (reward/errors) instead of removing all signal."""
    import gspo_lightning.rewards.math as math_rewards

    def broken(completion):
        raise IndexError("list index out of range")

    monkeypatch.setattr(math_rewards, "extract_final_answer", broken)
    with pytest.raises(IndexError, match="list index out of range"):
        math_accuracy(["p"], ["The answer is 3"], ["3"])
