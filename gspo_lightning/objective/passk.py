"""Evaluation metrics: the unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large
Language Models Trained on Code")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from gspo_lightning.errors import ConfigError

__all__ = ["Evaluation", "pass_at_k", "pass_at_k_from_scores", "record_eval_rollout"]


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"pass_at_k: {name} must be an int, got {value!r}")
    if value < 0:
        raise ConfigError(f"pass_at_k: {name} must be non-negative, got {value}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct.

    ``1 - C(n - c, k) / C(n, k)``, computed as in the Codex paper with the stable product
    ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``. Raises ``ValueError`` for negative
    arguments, ``k < 1``, ``k > n`` or ``c > n``.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        _check_count(name, value)
    if k < 1:
        raise ConfigError(f"pass_at_k: k must be >= 1, got {k}")
    if k > n:
        raise ConfigError(f"pass_at_k: k ({k}) must not exceed the number of samples n ({n})")
    if c > n:
        raise ConfigError(f"pass_at_k: c ({c}) must not exceed the number of samples n ({n})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_from_scores(
    scores: Sequence[Sequence[float]], k: int, threshold: float = 1.0
) -> float:
    """Mean pass@k over problems; ``scores[p]`` are the rewards of problem ``p``'s samples.

    A sample counts as correct when its score is ``>= threshold``. Every problem needs at
    least ``k`` samples (problems may have different sample counts).
    """
    if len(scores) == 0:
        raise ConfigError("pass_at_k_from_scores: scores is empty (no problems)")
    _check_count("k", k)
    if k < 1:
        raise ConfigError(f"pass_at_k: k must be >= 1, got {k}")
    total = 0.0
    for p, samples in enumerate(scores):
        n = len(samples)
        c = sum(1 for s in samples if s is not None and s >= threshold)
        if k > n:
            raise ConfigError(
                f"pass_at_k_from_scores: problem {p} has {n} samples, fewer than k={k}"
            )
        total += pass_at_k(n, c, k)
    return total / len(scores)


def record_eval_rollout(metrics, stage: str, rewards, lengths, group_size: int, accuracy_threshold: float) -> None:
    """Mean reward, accuracy, pass@1 and pass@k (k = samples per prompt) of one eval batch.

    ``metrics`` is a :class:`~gspo_lightning.training.metrics.StepMetrics`; ``rewards`` ``(N,)`` with
    the ``group_size`` samples of a prompt in consecutive rows."""
    import torch

    rewards = rewards.view(-1, group_size)
    correct = rewards >= accuracy_threshold
    n = rewards.numel()
    metrics.update(f"{stage}/reward_mean", rewards.mean(), n)
    metrics.update(f"{stage}/accuracy", correct.float().mean(), n)
    # the unbiased pass@1 over k samples is the share of correct samples
    metrics.update(f"{stage}/pass@1", correct.float().mean(), n)
    metrics.update(f"{stage}/response_length", lengths.float().mean(), n)
    if group_size > 1:
        per_prompt = [pass_at_k(group_size, int(c), group_size) for c in correct.sum(-1).tolist()]
        metrics.update(f"{stage}/pass@{group_size}", torch.tensor(per_prompt).mean(), len(per_prompt))


@dataclass
class Evaluation:
    """Held-out evaluation (``gspo validate / test`` and ``trainer.val_check_interval``).

    Args:
        val_num_samples: responses per validation prompt (pass@k uses k = this).
        val_temperature: validation sampling temperature (0: greedy).
        accuracy_threshold: a response counts as correct when its reward is at least this.
    """

    val_num_samples: int = 1
    val_temperature: float = 0.0
    accuracy_threshold: float = 1.0

    def problems(self) -> list[str]:
        problems = []
        if self.val_num_samples < 1:
            problems.append(f"val_num_samples must be >= 1, got {self.val_num_samples}")
        if self.val_temperature < 0:
            problems.append(f"val_temperature must be >= 0 (0: greedy), got {self.val_temperature}")
        return problems
