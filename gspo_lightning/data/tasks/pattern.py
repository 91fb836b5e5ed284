"""The pattern task: the alternate task at any response length, with held-out digit pairs.

Prompt ``repeat 3 7``; the ideal completion alternates the two digits for ``length`` words
(``3 7 3 7 ...``). The reward is the share of the ``length`` positions that are right, so
a response is graded on every one of its tokens: the task for experiments where the
response length itself is the variable (16 ... 256 tokens). Same 14-word vocabulary as echo
and alternate, so ``builtin:tiny-echo`` and the builtin MoE echo models fit.

Held-out pairs: :data:`HELDOUT_PAIRS` (20 of the 100 ordered digit pairs) never appear in
``split="train"`` rows; ``split="heldout"`` rows use only them. A model that scores well on
them has learned to copy and alternate, not to recall the pairs it was trained on.
``builtin:pattern`` / ``builtin:pattern-heldout`` are the two splits at length 32.
"""

from __future__ import annotations

import random
from typing import Literal

from gspo_lightning.errors import ConfigError

DEFAULT_LENGTH = 32
ALL_PAIRS = [(a, b) for a in range(10) for b in range(10)]
HELDOUT_PAIRS = frozenset(random.Random(2024).sample(ALL_PAIRS, 20))


def make_rows(num_rows: int, seed: int, length: int = DEFAULT_LENGTH,
              split: Literal["train", "heldout"] = "train") -> list[dict]:
    """Rows with a ``prompt`` and the ``target`` completion (``length`` words)."""
    if length < 1:
        raise ConfigError(f"length must be >= 1, got {length}")
    if split not in ("train", "heldout"):
        raise ConfigError(f"split must be 'train' or 'heldout', got {split!r}")
    pairs = sorted(HELDOUT_PAIRS) if split == "heldout" else [p for p in ALL_PAIRS if p not in HELDOUT_PAIRS]
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = rng.choice(pairs)
        target = " ".join(str(a if i % 2 == 0 else b) for i in range(length))
        rows.append({"prompt": f"repeat {a} {b}", "target": target})
    return rows


def heldout_rows(length: int = DEFAULT_LENGTH) -> list[dict]:
    """One row per held-out pair, in a fixed order (an evaluation set)."""
    return [{"prompt": f"repeat {a} {b}", "target": " ".join(str(a if i % 2 == 0 else b) for i in range(length))}
            for a, b in sorted(HELDOUT_PAIRS)]


def make_heldout_rows(num_rows: int, seed: int) -> list[dict]:
    """``builtin:pattern-heldout``: rows of the held-out pairs only."""
    return make_rows(num_rows, seed, split="heldout")


def pattern_reward(prompts: list[str], completions: list[str], target: list[str], **columns) -> list[float]:
    """Share of the target's positions where the completion has the target's word."""
    if len(completions) != len(target):
        raise ConfigError(f"pattern_reward got {len(completions)} completions but {len(target)} targets")
    scores = []
    for completion, wanted in zip(completions, target):
        goal = wanted.split()
        words = completion.split()[:len(goal)]
        scores.append(sum(w == g for w, g in zip(words, goal)) / max(1, len(goal)))
    return scores
