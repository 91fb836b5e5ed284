"""The alternate task: a harder relative of echo, for experiments that need room to improve.

Prompt ``repeat 3 7``; the ideal completion alternates the two digits for ``LENGTH`` words,
``3 7 3 7 3 7 3 7``. The reward is the share of the first ``LENGTH`` words that are right,
so partial answers earn partial credit. Unlike echo (one digit, four times) the policy has
to track the position parity and both prompt digits, and responses are twice as long:
a random policy scores about 0.07 and the tiny builtin models need a few hundred RL steps.
Same 14-word vocabulary as echo, so ``builtin:tiny-echo`` / ``builtin:tiny-moe-echo`` fit.
"""

from __future__ import annotations

import random

from gspo_lightning.errors import ConfigError

LENGTH = 8


def make_rows(num_rows: int, seed: int) -> list[dict]:
    """Rows with a ``prompt`` and the ``target`` completion (a string column for the reward)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = str(rng.randrange(10)), str(rng.randrange(10))
        target = " ".join(a if i % 2 == 0 else b for i in range(LENGTH))
        rows.append({"prompt": f"repeat {a} {b}", "target": target})
    return rows


def alternate_reward(prompts: list[str], completions: list[str], target: list[str], **columns) -> list[float]:
    """Share of the first ``LENGTH`` words of each completion equal to the target's word there."""
    if len(completions) != len(target):
        raise ConfigError(f"alternate_reward got {len(completions)} completions but {len(target)} targets")
    scores = []
    for completion, wanted in zip(completions, target):
        words, goal = completion.split()[:LENGTH], wanted.split()
        scores.append(sum(w == g for w, g in zip(words, goal)) / len(goal))
    return scores
