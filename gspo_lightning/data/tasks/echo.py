"""The echo task: an offline task with a verifiable reward that a tiny model learns by RL alone.

Prompt ``repeat 7``; the ideal completion is the digit four times, ``7 7 7 7``. The reward
is the share of the first four words that are the digit, so a random policy over the
14-word vocabulary scores about 0.07 and every step towards the answer is rewarded.
Nothing is learned before RL: the model starts from random weights.
"""

from __future__ import annotations

import random

from gspo_lightning.errors import ConfigError

REPEATS = 4


def make_rows(num_rows: int, seed: int) -> list[dict]:
    """Rows with a ``prompt`` and the ``target`` digit (a string column for the reward)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        digit = str(rng.randrange(10))
        rows.append({"prompt": f"repeat {digit}", "target": digit})
    return rows


def echo_reward(prompts: list[str], completions: list[str], target: list[str], **columns) -> list[float]:
    """Share of the first ``REPEATS`` words of each completion equal to its target digit."""
    if len(completions) != len(target):
        raise ConfigError(f"echo_reward got {len(completions)} completions but {len(target)} targets")
    scores = []
    for completion, digit in zip(completions, target):
        words = completion.split()[:REPEATS]
        scores.append(sum(word == digit for word in words) / REPEATS)
    return scores
