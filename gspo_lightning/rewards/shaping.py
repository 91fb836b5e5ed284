"""Shaping rewards: output format and the DAPO soft overlong punishment.

Reward functions follow the TRL convention
``fn(prompts, completions, **columns) -> list[float]``; unknown columns are ignored.
Their parameters (``pattern``, ``max_length``, ``buffer``) are bound from the config,
``functools.partial``-style.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from gspo_lightning.errors import ConfigError
from gspo_lightning.rewards.math import _as_text

__all__ = ["format_reward", "length_penalty", "DEFAULT_FORMAT_PATTERN"]

DEFAULT_FORMAT_PATTERN = r"(?s)<think>.*?</think>\s*<answer>.*?</answer>"


def format_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    pattern: str = DEFAULT_FORMAT_PATTERN,
    **kwargs: Any,
) -> list[float]:
    """1.0 where the stripped completion fully matches ``pattern`` (``re.fullmatch``), else 0.0.

    The default asks for ``<think>...</think>`` followed by ``<answer>...</answer>`` and
    nothing else. An invalid ``pattern`` raises ``ValueError``.
    """
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"format_reward: invalid regex pattern {pattern!r}: {e}") from e
    scores = []
    for completion in completions:
        text = _as_text(completion)
        scores.append(1.0 if text is not None and regex.fullmatch(text.strip()) else 0.0)
    return scores


def _soft_overlong(length: int, max_length: int, buffer: int) -> float:
    limit = max_length - buffer
    if length <= limit:
        return 0.0
    if length <= max_length:
        return (limit - length) / buffer
    return -1.0


def length_penalty(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    max_length: int,
    buffer: int,
    completion_lengths: Optional[Sequence[int]] = None,
    **kwargs: Any,
) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

    For a completion of length ``L`` -- in tokens when ``completion_lengths`` is given,
    else in characters::

        0                              if L <= max_length - buffer
        (max_length - buffer - L) / buffer   if max_length - buffer < L <= max_length
        -1                             if L > max_length

    so the penalty falls linearly from 0 to -1 across the last ``buffer`` units.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        raise ConfigError(f"length_penalty: max_length must be a positive int, got {max_length!r}")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer <= 0:
        raise ConfigError(f"length_penalty: buffer must be a positive int, got {buffer!r}")
    if buffer > max_length:
        raise ConfigError(
            f"length_penalty: buffer ({buffer}) must not exceed max_length ({max_length})"
        )
    if completion_lengths is not None:
        if len(completion_lengths) != len(completions):
            raise ConfigError(
                f"length_penalty: got {len(completions)} completions but "
                f"{len(completion_lengths)} completion_lengths"
            )
        lengths = [int(n) for n in completion_lengths]
    else:
        lengths = [len(_as_text(c) or "") for c in completions]
    return [_soft_overlong(n, max_length, buffer) for n in lengths]
