"""Answer-checking rewards for math word problems (GSM8K, MATH-style answers).

Reward functions follow the TRL convention::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

where ``columns`` holds the other dataset columns aligned with ``completions`` (here
``answer``); unknown columns are accepted and ignored.

The core is three small helpers:

* :func:`extract_reference_answer` -- the reference answer from a dataset ``answer`` cell:
  a bare answer (``"72"``, ``"\\frac{1}{2}"``) or a GSM8K solution ending in ``#### N``;
* :func:`extract_final_answer` -- the final answer of a model completion, looked for in
  this order: ``#### N``, ``\\boxed{...}`` (nested braces), ``The answer is N``,
  ``Answer: N``, ``A: N``; otherwise the last number in the text;
* :func:`answers_match` -- numbers compare by value (commas as thousands separators,
  ``$``, ``%``, trailing ``.0``/period, ``3/4``, ``\\frac{3}{4}``, negatives); otherwise
  the normalized strings compare equal; otherwise, when both sides look like LaTeX and the
  optional ``math-verify`` package is installed, its symbolic check decides.

Nothing here raises on bad completions (``None``, empty, garbage): they score ``0.0``.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Any, Optional, Sequence

from gspo_lightning.errors import ConfigError
from gspo_lightning.rewards.base import FailureCounts

__all__ = [
    "math_accuracy",
    "exact_match",
    "extract_reference_answer",
    "extract_final_answer",
    "answers_match",
    "parse_number",
]

# --------------------------------------------------------------------------- text input


def _as_text(value: Any) -> Optional[str]:
    """The text of a completion or answer cell, or ``None`` if there is none.

    Accepts plain strings, numbers (an ``answer`` column of ints), and TRL's
    conversational format (a list of ``{"role", "content"}`` messages: the last
    message's content).
    """
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float, Fraction)):
        return str(value)
    if isinstance(value, dict):
        return _as_text(value.get("content"))
    if isinstance(value, (list, tuple)) and value:
        return _as_text(value[-1])
    return None


def _check_lengths(completions: Sequence[Any], answer: Sequence[Any]) -> None:
    if len(completions) != len(answer):
        raise ConfigError(
            f"got {len(completions)} completions but {len(answer)} answers; "
            "the answer column must be aligned with the completions"
        )


# --------------------------------------------------------------------------- numbers

# A number inside running text: optional minus (not after a word/closing bracket, so
# "3-5" gives 3 and 5), thousands groups "1,080" or plain digits, optional decimals,
# optional "/denominator".
_NUMBER_IN_TEXT = re.compile(
    r"(?:(?<![\w)\]}])-)?"
    r"(?<![\d.])"
    r"(?:\d{1,3}(?:,\d{3})+(?![\d,])|\d+)(?:\.\d+)?"
    r"(?:/\d+(?:\.\d+)?)?"
    r"|(?:(?<![\w)\]}])-)?(?<![\d.])\.\d+"
)

_DECIMAL = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_RE_DECIMAL = re.compile(_DECIMAL)
_RE_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_RE_SLASH_FRACTION = re.compile(rf"({_DECIMAL})/({_DECIMAL})")
_RE_LATEX_FRACTION = re.compile(rf"([+-]?)\\[dt]?frac\{{({_DECIMAL})\}}\{{({_DECIMAL})\}}")
_RE_LATEX_FRACTION_SHORT = re.compile(r"([+-]?)\\[dt]?frac(\d)(\d)")
# "18 dollars", "3.5 cm": a number followed by unit words (whitespace-separated).
_RE_NUMBER_WITH_UNITS = re.compile(r"(.*?[\d}])(?:\s+[A-Za-z]+\.?)+")
_RE_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_RE_LATEXISH = re.compile(r"\\[A-Za-z]+|[\^_{}]")

# Removed before reading a number: currency and percent signs, math delimiters, LaTeX
# spacing, "{,}" thousands separators, \left / \right.
_NUMBER_NOISE = (
    ("{,}", ","),
    ("\\$", ""),
    ("$", ""),
    ("\\%", ""),
    ("%", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("\\;", ""),
    ("\\:", ""),
    ("\\ ", " "),
    ("\\(", ""),
    ("\\)", ""),
    ("\\[", ""),
    ("\\]", ""),
    ("\\left", ""),
    ("\\right", ""),
    ("−", "-"),  # unicode minus
)


def _unwrap_text(s: str) -> str:
    """``\\text{ dollars}`` -> `` dollars `` (spaced, so it reads as a unit word)."""
    return _RE_TEXT_WRAPPER.sub(lambda m: f" {m.group(1)} ", s)


def _strip_number_noise(s: str) -> str:
    s = _unwrap_text(s)
    for old, new in _NUMBER_NOISE:
        s = s.replace(old, new)
    s = s.strip().rstrip(".").strip()
    return s


def _parse_plain_number(s: str) -> Optional[Fraction]:
    """A whole string that is one number: decimal, ``a/b``, ``\\frac{a}{b}``; else None."""
    s = re.sub(r"\s+", "", s)
    if _RE_THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    try:
        if _RE_DECIMAL.fullmatch(s):
            return Fraction(s)
        m = _RE_SLASH_FRACTION.fullmatch(s)
        if m:
            den = Fraction(m.group(2))
            return Fraction(m.group(1)) / den if den else None
        m = _RE_LATEX_FRACTION.fullmatch(s) or _RE_LATEX_FRACTION_SHORT.fullmatch(s)
        if m:
            den = Fraction(m.group(3))
            if not den:
                return None
            value = Fraction(m.group(2)) / den
            return -value if m.group(1) == "-" else value
        if s.startswith("(") and s.endswith(")"):  # "(-5)"
            return _parse_plain_number(s[1:-1])
    except (ValueError, ZeroDivisionError):
        return None
    return None


def parse_number(text: Optional[str]) -> Optional[Fraction]:
    """The exact value of an answer string that is a single number, else ``None``.

    Ignores ``$``, ``%``, thousands commas (``1,080``), a trailing period, surrounding
    math delimiters and trailing unit words (``18 dollars``, ``5\\text{ cm}``); reads
    decimals (``2.50``), fractions ``3/4`` and ``\\frac{3}{4}`` / ``\\dfrac`` / ``\\tfrac``.
    """
    if not text:
        return None
    s = _strip_number_noise(text)
    if not s:
        return None
    value = _parse_plain_number(s)
    if value is None:
        m = _RE_NUMBER_WITH_UNITS.fullmatch(s)
        if m:
            value = _parse_plain_number(m.group(1))
    return value


def _last_number(text: str) -> Optional[str]:
    matches = _NUMBER_IN_TEXT.findall(text)
    return matches[-1] if matches else None


# --------------------------------------------------------------------------- extraction

_RE_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_RE_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_RE_ANSWER_IS = re.compile(r"(?i:\bthe\s+(?:final\s+)?answer\s+is\b)[ \t]*:?\s*([^\n]*)")
_RE_ANSWER_COLON = re.compile(r"(?i:\b(?:final\s+)?answer\s*:)\s*([^\n]*)")
_RE_A_COLON = re.compile(r"(?<![\w.])A:\s*([^\n]*)")
# A sentence ends at a period followed by whitespace or the end ("3.5" is not cut).
_RE_SENTENCE_END = re.compile(r"\.(?=\s|$)")


def _boxed_contents(text: str) -> Optional[str]:
    """Contents of the last ``\\boxed{...}`` (balanced, nested braces) or ``\\boxed N``."""
    for m in reversed(list(_RE_BOXED.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        content = text[i + 1 : j].strip()
                        if content:
                            return content
                        break
            continue  # unbalanced (truncated) or empty: try an earlier \boxed
        token = re.match(r"[^\s$]+", text[i:])
        if token:
            return token.group(0)
    return None


def _tidy_span(span: str) -> Optional[str]:
    """The answer at the start of the text after a marker like ``The answer is``.

    Keeps the first sentence; returns it if it is a number or LaTeX, else its leading
    number, else a short single token (``B``, ``(1,2)``), else ``None``.
    """
    span = _RE_SENTENCE_END.split(span, maxsplit=1)[0].strip().rstrip(".,;:!").strip()
    if not span:
        return None
    boxed = _boxed_contents(span)
    if boxed is not None:
        return boxed
    if parse_number(span) is not None or _RE_LATEXISH.search(span):
        return span
    m = re.match(r"[$\s(]*(?:\\\$)?\s*", span)
    rest = span[m.end():]
    lead = _NUMBER_IN_TEXT.match(rest)
    if lead:
        return lead.group(0)
    if " " not in span:
        return span
    return None


def extract_reference_answer(reference: Any) -> Optional[str]:
    """The answer string of a dataset ``answer`` cell.

    ``"...\\n#### 1,080"`` -> ``"1,080"``; ``"\\boxed{\\frac12}"`` -> ``"\\frac12"``;
    a bare answer is returned stripped; ``None``/empty -> ``None``.
    """
    text = _as_text(reference)
    if text is None:
        return None
    hashes = _RE_HASHES.findall(text)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    boxed = _boxed_contents(text)
    if boxed is not None:
        return boxed
    text = text.strip()
    return text or None


def extract_final_answer(completion: Any) -> Optional[str]:
    """The final answer written in a completion, or ``None`` if there is none.

    Looks for, in order (the last occurrence of each): ``#### N``, ``\\boxed{...}``,
    ``The (final) answer is N``, ``(Final) Answer: N``, ``A: N``; falls back to the last
    number in the text.
    """
    text = _as_text(completion)
    if not text or not text.strip():
        return None

    hashes = _RE_HASHES.findall(text)
    if hashes:
        answer = _tidy_span(hashes[-1])
        if answer is not None:
            return answer

    boxed = _boxed_contents(text)
    if boxed is not None:
        return boxed

    for pattern in (_RE_ANSWER_IS, _RE_ANSWER_COLON, _RE_A_COLON):
        spans = pattern.findall(text)
        if spans:
            answer = _tidy_span(spans[-1])
            if answer is not None:
                return answer

    return _last_number(text)


# --------------------------------------------------------------------------- comparison


def _normalize_string(s: str) -> str:
    s = _unwrap_text(s)
    for old, new in _NUMBER_NOISE:
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


class MathVerifyFailed(RuntimeError):
    """math-verify raised (or timed out) comparing two answers: neither equal nor unequal."""


def _math_verify_equal(predicted: str, reference: str) -> bool:
    """Symbolic equivalence through the optional ``math-verify`` package (False if absent)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    # math-verify's timeouts use signal.alarm, which only works in the main thread.
    in_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if in_main else None

    def wrap(s: str) -> str:
        s = s.strip()
        return s if "$" in s or s.startswith("\\[") or s.startswith("\\(") else f"${s}$"

    try:
        gold = parse(wrap(reference), parsing_timeout=timeout)
        pred = parse(wrap(predicted), parsing_timeout=timeout)
        if not gold or not pred:
            return False
        return bool(verify(gold, pred, timeout_seconds=timeout))
    except Exception as err:  # noqa: BLE001 -- sympy's errors, math-verify's timeouts: undecided, not unequal
        raise MathVerifyFailed(f"{type(err).__name__}: {err}") from err


def answers_match(predicted: Optional[str], reference: Optional[str]) -> bool:
    """Whether an extracted answer equals the reference answer.

    1. both read as numbers (:func:`parse_number`): equal by exact value;
    2. otherwise the strings equal after removing whitespace, ``$``, ``\\text{}``;
    3. otherwise, when both look like LaTeX, ``math-verify`` (if installed) decides; it raising
       or timing out raises :class:`MathVerifyFailed` (undecided: the caller leaves the sample unscored).
    """
    if not predicted or not reference:
        return False
    p_num, r_num = parse_number(predicted), parse_number(reference)
    if p_num is not None and r_num is not None:
        return p_num == r_num
    p_str, r_str = _normalize_string(predicted), _normalize_string(reference)
    if p_str and p_str == r_str:
        return True
    if _RE_LATEXISH.search(predicted) and _RE_LATEXISH.search(reference):
        return _math_verify_equal(predicted, reference)
    return False


# --------------------------------------------------------------------------- rewards


# math_accuracy's unscored samples (reward/<name>/failed): a reference without an answer, math-verify failing
FAILURES = FailureCounts("math_accuracy")


def _score_one(completion: Any, reference: Any) -> Optional[float]:
    # no blanket except: a completion without an answer scores 0 (the extractors return None for
    # any input, text or not), but a bug in scoring raises, and the run's reward handling names it
    # (model.rollout.on_reward_error: raise stops with a checkpoint; zero scores 0 and counts it)
    ref = extract_reference_answer(reference)
    if ref is None:  # the row's fault, not the completion's: no score rather than a silent 0
        FAILURES.add("no reference", f"the answer column's {reference!r} holds no answer to compare with; fix the row")
        return None
    pred = extract_final_answer(completion)
    try:
        return 1.0 if answers_match(pred, ref) else 0.0
    except MathVerifyFailed as err:
        FAILURES.add("math-verify", f"math-verify could not compare {pred!r} with {ref!r}: {err}")
        return None


def math_accuracy(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any
) -> list[Optional[float]]:
    """1.0 where the completion's final answer equals the reference ``answer``, else 0.0;
    ``None`` (unscored, counted in ``reward/<name>/failed``) where the reference holds no
    answer or math-verify fails to compare the two.

    ``answer`` cells may be bare answers (``"72"``, ``"\\frac{1}{2}"``) or GSM8K
    solutions ending in ``#### N``. Raises ``ValueError`` if ``answer`` and
    ``completions`` differ in length.
    """
    _check_lengths(completions, answer)
    return [_score_one(c, a) for c, a in zip(completions, answer)]


math_accuracy.pop_failures = FAILURES.pop  # read by the composer after every batch


def exact_match(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any
) -> list[float]:
    """1.0 where the completion equals ``answer`` up to whitespace (runs collapse to one
    space, ends stripped), else 0.0."""
    _check_lengths(completions, answer)
    scores = []
    for c, a in zip(completions, answer):
        c_text, a_text = _as_text(c), _as_text(a)
        if c_text is None or a_text is None:
            scores.append(0.0)
            continue
        scores.append(1.0 if " ".join(c_text.split()) == " ".join(a_text.split()) else 0.0)
    return scores
