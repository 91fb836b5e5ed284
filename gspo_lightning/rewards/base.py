"""Reward functions: how they are named in configs, combined, and guarded.

A reward function is any callable ``fn(prompts, completions, **columns) -> list[float]``
(the TRL convention): ``columns`` holds every other dataset column, one entry per
completion, plus ``completion_lengths`` (tokens per completion). Configs name functions
by import path with their own keyword arguments and a weight:

.. code-block:: yaml

    rewards:
      - function: gspo_lightning.rewards.math_accuracy
      - function: gspo_lightning.rewards.format_reward
        weight: 0.2
        kwargs: {pattern: "(?s).*####.*"}
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

RewardFunction = Callable[..., list]


@dataclass
class RewardSpec:
    """One reward function of the run.

    Args:
        function: import path, ``package.module.function`` or ``package.module:function``.
        weight: its weight in the combined reward.
        kwargs: keyword arguments bound to the function.
        name: the name its metrics are logged under (default: the function's name).
    """

    function: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    name: Optional[str] = None


class RewardError(RuntimeError):
    """A reward function failed; the message names the function and the sample."""


def import_function(path: str) -> Callable:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward function {path!r} is not an import path like 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} of reward function {path!r}: {err}") from err
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (reward function {path!r})") from None
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is not callable")
    return fn


class RewardComposer:
    """Scores completions with several reward functions and combines them by weight.

    ``on_error="raise"`` stops at the first failing call (an exception, the wrong number of
    scores, a NaN or non-number) with a message naming the function and the sample;
    ``on_error="zero"`` scores the affected samples 0 and counts them in ``error_counts``.
    """

    def __init__(self, specs: list[Union[RewardSpec, dict, Callable]], on_error: str = "raise"):
        if not specs:
            raise ValueError("no reward functions configured: set model.rewards to at least one function")
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_reward_error must be 'raise' or 'zero', got {on_error!r}")
        self.on_error = on_error
        self.functions: list[tuple[str, float, Callable]] = []
        for spec in specs:
            if callable(spec) and not isinstance(spec, RewardSpec):
                name = getattr(spec, "__name__", type(spec).__name__)
                self.functions.append((name, 1.0, spec))
                continue
            if isinstance(spec, dict):
                spec = RewardSpec(**spec)
            fn = import_function(spec.function)
            name = spec.name or spec.function.replace(":", ".").rpartition(".")[2]
            if spec.kwargs:
                fn = functools.partial(fn, **spec.kwargs)
            self.functions.append((name, float(spec.weight), fn))
        names = [name for name, _, _ in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must be unique, got {names}: set `name` on the duplicates")
        self.error_counts = {name: 0 for name in names}

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.functions]

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> tuple[list[float], dict[str, list[float]]]:
        """``(combined reward per completion, {function name: its scores})``."""
        total = [0.0] * len(completions)
        per_function = {}
        for name, weight, fn in self.functions:
            scores = self._score(name, fn, prompts, completions, columns)
            per_function[name] = scores
            total = [acc + weight * s for acc, s in zip(total, scores)]
        return total, per_function

    def _fail(self, name: str, message: str, count: int) -> list[float]:
        if self.on_error == "raise":
            raise RewardError(f"reward function {name!r}: {message}. Fix the function, or set "
                              f"model.on_reward_error=zero to score such samples 0 and count them.")
        self.error_counts[name] += count
        return [0.0] * count

    def _score(self, name, fn, prompts, completions, columns) -> list[float]:
        n = len(completions)
        try:
            raw = fn(prompts, completions, **columns)
        except Exception as err:  # noqa: BLE001 - any failure of user code is reported the same way
            return self._fail(name, f"raised {type(err).__name__}: {err} (batch of {n}, first prompt {prompts[0]!r})", n)
        try:
            scores = [float(s) for s in raw]
        except (TypeError, ValueError) as err:
            return self._fail(name, f"returned something other than a list of numbers ({err})", n)
        if len(scores) != n:
            return self._fail(name, f"returned {len(scores)} scores for {n} completions", n)
        for i, score in enumerate(scores):
            if not math.isfinite(score):
                if self.on_error == "raise":
                    self._fail(name, f"returned {score} for sample {i} (prompt {prompts[i]!r}, completion {completions[i]!r})", 1)
                self.error_counts[name] += 1
                scores[i] = 0.0
        return scores
