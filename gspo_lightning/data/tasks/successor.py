"""The successor task: the CPU quickstart's task, one a model has to learn.

Prompt ``next 7``; the ideal completion is the next digit four times, ``8 8 8 8`` (9 is
followed by 0). The reward is the share of the first four words that are that digit, so a
random policy over the 13-word vocabulary scores about 0.08 and every step towards the
answer is rewarded. Unlike echo (``repeat 7`` -> ``7 7 7 7``), the answer is not in the
prompt: an untrained tied-embedding model decodes greedily by repeating its last input
token, which solves echo before any training and scores 0 here. Nothing is learned before
RL: the model starts from random weights.
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
        digit = rng.randrange(10)
        rows.append({"prompt": f"next {digit}", "target": str((digit + 1) % 10)})
    return rows


def successor_reward(prompts: list[str], completions: list[str], target: list[str], **columns) -> list[float]:
    """Share of the first ``REPEATS`` words of each completion equal to its target digit."""
    if len(completions) != len(target):
        raise ConfigError(f"successor_reward got {len(completions)} completions but {len(target)} targets")
    scores = []
    for completion, digit in zip(completions, target):
        words = completion.split()[:REPEATS]
        scores.append(sum(word == digit for word in words) / REPEATS)
    return scores
