"""The addition task: single-digit sums asked in words, for a pretrained instruct model.

Prompt ``What is 7 + 5? Answer with only the number.``; the reward is strict: 1 when the last
integer in the response is the sum, else 0 (a wrong, missing or truncated answer scores 0).
SmolLM2-135M-Instruct (``builtin:smollm2-135m-instruct``) answers it about half the time
greedily and a quarter of the time sampled at temperature 0.7, often at length or with a wrong
last number: a task it half-knows, where RL has signal from the first step.

Held-out pairs: :data:`HELDOUT_PAIRS` (30 of the 100 ordered pairs ``a + b``, ``a, b`` in 0..9)
never appear in ``builtin:addition`` rows; ``builtin:addition-heldout`` lists each of them once
(a fixed evaluation set).

``builtin:addition-2digit`` asks the same question with ``a, b`` in 10..99, a task the model
rarely solves (3-8% of sampled answers right, docs/quickstart.md), so most groups of a step
have all-zero rewards: the case dynamic sampling is for. Its held-out set,
``builtin:addition-2digit-heldout``, is :data:`HELDOUT_2DIGIT_PAIRS` (50 of the 8100 pairs).
"""

from __future__ import annotations

import random
import re

from gspo_lightning.errors import ConfigError

QUESTION = "What is {a} + {b}? Answer with only the number."
ALL_PAIRS = [(a, b) for a in range(10) for b in range(10)]
HELDOUT_PAIRS = tuple(sorted(random.Random(30).sample(ALL_PAIRS, 30)))
TRAIN_PAIRS = tuple(p for p in ALL_PAIRS if p not in set(HELDOUT_PAIRS))
TWO_DIGIT_PAIRS = [(a, b) for a in range(10, 100) for b in range(10, 100)]
HELDOUT_2DIGIT_PAIRS = tuple(sorted(random.Random(31).sample(TWO_DIGIT_PAIRS, 50)))
_INTEGER = re.compile(r"-?\d+")


def _row(a: int, b: int) -> dict:
    return {"prompt": QUESTION.format(a=a, b=b), "answer": str(a + b)}


def make_rows(num_rows: int, seed: int) -> list[dict]:
    """``builtin:addition``: ``num_rows`` questions drawn from the training pairs."""
    rng = random.Random(seed)
    return [_row(*rng.choice(TRAIN_PAIRS)) for _ in range(num_rows)]


def make_heldout_rows(num_rows: int, seed: int) -> list[dict]:
    """``builtin:addition-heldout``: every held-out pair once, in a fixed order (``seed`` unused:
    the evaluation set is the same in every run), at most ``num_rows`` of them."""
    return [_row(a, b) for a, b in HELDOUT_PAIRS[:num_rows]]


def make_2digit_rows(num_rows: int, seed: int) -> list[dict]:
    """``builtin:addition-2digit``: ``num_rows`` two-digit questions, none of the held-out pairs."""
    rng, heldout = random.Random(seed), set(HELDOUT_2DIGIT_PAIRS)
    rows = []
    while len(rows) < num_rows:
        pair = rng.choice(TWO_DIGIT_PAIRS)
        if pair not in heldout:
            rows.append(_row(*pair))
    return rows


def make_2digit_heldout_rows(num_rows: int, seed: int) -> list[dict]:
    """``builtin:addition-2digit-heldout``: every held-out two-digit pair once, in a fixed order."""
    return [_row(a, b) for a, b in HELDOUT_2DIGIT_PAIRS[:num_rows]]


def last_integer(text: str):
    """The last integer written in ``text`` (``"7 + 5 = 12."`` -> 12), or None."""
    found = _INTEGER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def addition_reward(prompts: list, completions: list, answer: list[str], **columns) -> list[float]:
    """1.0 when the completion's last integer equals ``answer``, else 0.0."""
    if len(completions) != len(answer):
        raise ConfigError(f"addition_reward got {len(completions)} completions but {len(answer)} answers")
    scores = []
    for completion, wanted in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]  # conversational
        scores.append(1.0 if last_integer(text) == int(wanted) else 0.0)
    return scores
