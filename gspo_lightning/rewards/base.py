"""Reward functions: how they are named in configs, called, combined, and guarded.

A reward function follows TRL's convention exactly: it is called with keyword arguments,

.. code-block:: python

    fn(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]

``prompts`` holds one prompt per completion: its text, or for a conversational dataset
its list of chat messages; then each completion is ``[{"role": "assistant", "content":
text}]`` instead of the text (a multi-turn episode: every message after the prompt, the
assistant's turns and the environment's replies, in order). ``completion_ids`` are the completion's token ids;
``columns`` holds every other dataset column, one entry per completion, plus
``completion_lengths`` (tokens per completion). A score of ``None`` means "no score for
this sample": the weighted sum skips it, and a sample no function of non-zero weight scored is marked
unscored (its advantage is 0). ``async def`` functions are awaited, concurrently.
Configs name functions by import path with their own keyword arguments and a weight:

.. code-block:: yaml

    rewards:
      - function: gspo_lightning.rewards.math_accuracy
      - function: gspo_lightning.rewards.format_reward
        weight: 0.2
        kwargs: {pattern: "(?s).*####.*"}
      - function: trl.rewards.get_soft_overlong_punishment   # a factory: called once with kwargs
        factory: true
        kwargs: {max_completion_len: 256, soft_punish_cache: 32}
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, NamedTuple, Optional, Union

from gspo_lightning._imports import import_callable
from gspo_lightning.errors import ConfigError

# the keyword arguments every reward function receives besides the dataset columns
RESERVED = ("prompts", "completions", "completion_ids")


@dataclass
class RewardSpec:
    """One reward function of the run.

    Args:
        function: import path, ``package.module.function`` or ``package.module:function``;
            a module in the working directory works too (``myrewards.score``).
        weight: its weight in the combined reward.
        kwargs: keyword arguments bound to the function (with ``factory``: passed to the factory).
        name: the name its metrics are logged under (default: the function's name).
        factory: ``function(**kwargs)`` returns the reward function (TRL's ``get_...`` helpers).
    """

    function: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    name: Optional[str] = None
    factory: bool = False


class RewardError(RuntimeError):
    """A reward function failed; the message names the function and the sample."""


class RewardUnavailable(RewardError):
    """A reward's service (a judge's endpoint) failed most of a batch: the run stops, whatever
    ``on_reward_error`` says (scoring the batch 0 would train on noise)."""


class Failures(NamedTuple):
    """What :meth:`FailureCounts.pop` returns: samples unscored since the last pop, by whom, the last reason."""

    count: int
    who: str
    last: Optional[str]


class FailureCounts:
    """The samples a reward function left unscored (``None``) because scoring failed, for
    ``reward/<name>/failed``; the first failure of each kind is printed once, with its reason.

    A function exposes ``pop_failures = counts.pop`` (the composer reads it after every
    rollout). Thread-safe: an asynchronous producer scores on its own thread."""

    def __init__(self, who: str):
        self.who = who
        self._count = 0
        self._last: Optional[str] = None
        self._kinds: set[str] = set()
        self._lock = threading.Lock()

    def add(self, kind: str, reason: str) -> None:
        with self._lock:
            self._count += 1
            self._last = reason
            first = kind not in self._kinds
            self._kinds.add(kind)
        if first:
            print(f"{self.who}: a sample left unscored ({reason}); such failures are counted in "
                  f"reward/<name>/failed and not printed again", file=sys.stderr)

    def pop(self) -> Failures:
        with self._lock:
            popped = Failures(self._count, self.who, self._last)
            self._count, self._last = 0, None
        return popped


# Event loops that outlive one batch (the rollout worker's reward loop, rollout/scoring.py), and
# what to close with them: a judge keeps its HTTP connections open on such a loop from step to
# step instead of opening them again for every group
_LONG_LIVED_LOOPS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Callable[[], Awaitable]]]" = \
    weakref.WeakKeyDictionary()


def mark_long_lived(loop: asyncio.AbstractEventLoop) -> None:
    _LONG_LIVED_LOOPS[loop] = []


def is_long_lived(loop: asyncio.AbstractEventLoop) -> bool:
    return loop in _LONG_LIVED_LOOPS


def close_with(loop: asyncio.AbstractEventLoop, closer: Callable[[], Awaitable]) -> None:
    """Await ``closer()`` on ``loop`` when its owner closes it (:func:`close_long_lived`)."""
    _LONG_LIVED_LOOPS[loop].append(closer)


async def close_long_lived() -> None:
    """Close what was registered on the running loop (called on it by its owner, before it stops)."""
    for closer in _LONG_LIVED_LOOPS.pop(asyncio.get_running_loop(), []):
        await closer()


def import_function(path: str) -> Callable:
    return import_callable(path, "reward function")


def is_async_callable(fn: Callable) -> bool:
    """Whether calling ``fn`` returns a coroutine (functions, partials and callable objects)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def is_conversational(prompt: Any) -> bool:
    """A prompt given as chat messages ``[{role, content}, ...]`` (TRL's conversational format)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def _run_coroutines(coroutines: list) -> list:
    """Run coroutines concurrently to completion, also from inside a running event loop."""
    async def gather():
        return await asyncio.gather(*coroutines, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    # a loop already runs in this thread (a notebook): use a fresh one in another thread
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()


class RewardComposer:
    """Scores completions with several reward functions and combines them by weight.

    ``on_error="raise"`` stops at the first failing call (an exception, the wrong number of
    scores, a NaN or non-number) with a message naming the function and the sample;
    ``on_error="zero"`` scores the affected samples 0 and counts them in ``error_counts``.
    ``None`` is not a failure: it is "no score" (see the module docstring).
    """

    def __init__(self, specs: list[Union[RewardSpec, dict, Callable]], on_error: str = "raise"):
        if not specs:
            raise ConfigError("no reward functions configured: set model.rewards to at least one function")
        if on_error not in ("raise", "zero"):
            raise ConfigError(f"on_reward_error must be 'raise' or 'zero', got {on_error!r}")
        self.on_error = on_error
        self.functions: list[tuple[str, float, Callable]] = []
        for spec in specs:
            if callable(spec) and not isinstance(spec, RewardSpec):
                self.functions.append((_callable_name(spec), 1.0, spec))
                continue
            if isinstance(spec, dict):
                spec = RewardSpec(**spec)
            fn = import_function(spec.function)
            if spec.factory:
                fn = fn(**spec.kwargs)
                if not callable(fn):
                    raise ConfigError(f"reward factory {spec.function!r} returned {type(fn).__name__}, not a function")
            elif spec.kwargs:
                fn = functools.partial(fn, **spec.kwargs)
            name = spec.name or spec.function.replace(":", ".").rpartition(".")[2]
            self.functions.append((name, float(spec.weight), fn))
        names = self.names
        if len(set(names)) != len(names):
            raise ConfigError(f"reward function names must be unique, got {names}: set `name` on the duplicates")
        self.error_counts = {name: 0 for name in names}

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.functions]

    def pop_failure_counts(self, samples: int) -> dict[str, float]:
        """``reward/<name>/failed``: the samples each counting function (one with
        ``pop_failures()``: the judge, ``math_accuracy``) left unscored since the last call, out of
        a rollout's ``samples``; every such function every time, 0 included, so each rank logs
        the same names. More than half unscored raises :class:`RewardUnavailable` (a judge that
        is down, a dataset without answers): the run stops, whatever ``on_reward_error`` says."""
        counts = {}
        for name, _, fn in self.functions:
            if not callable(getattr(fn, "pop_failures", None)):
                continue
            failures = fn.pop_failures()
            if samples and failures.count * 2 > samples:
                raise RewardUnavailable(f"reward function {name!r} ({failures.who}) left {failures.count} of {samples} "
                                        f"samples unscored (the last: {failures.last})")
            counts[f"reward/{name}/failed"] = float(failures.count)
        return counts

    def __call__(
        self,
        *,
        prompts: list,
        completions: list,
        completion_ids: Optional[list[list[int]]] = None,
        columns: Optional[dict[str, list]] = None,
    ) -> tuple[list[float], dict[str, list[float]], list[bool]]:
        """Score a batch; every argument holds one entry per completion.

        Returns ``(total, components, scored)``: ``total[i]`` is the weighted sum of the
        scores sample ``i`` got (``None`` scores skipped; 0.0 where it got none);
        ``components[name][i]`` is each function's score, NaN where it gave ``None``
        (average those with a NaN-aware mean); ``scored[i]`` is False where no function of
        non-zero weight scored sample ``i`` (a weight-0 function is a monitor: logged only).
        """
        kwargs = self._arguments(prompts, completions, completion_ids, columns)
        raw: dict[str, Any] = {}
        pending = []
        for name, _, fn in self.functions:
            if is_async_callable(fn):
                pending.append(name)
                raw[name] = fn(**kwargs)  # a coroutine, awaited below with the others
                continue
            try:
                raw[name] = fn(**kwargs)
            except Exception as err:  # noqa: BLE001 - any failure of user code is reported the same way
                raw[name] = err
        if pending:
            for name, result in zip(pending, _run_coroutines([raw[name] for name in pending])):
                raw[name] = result
        return self._combine(raw, prompts, completions)

    async def score_async(
        self,
        *,
        prompts: list,
        completions: list,
        completion_ids: Optional[list[list[int]]] = None,
        columns: Optional[dict[str, list]] = None,
    ) -> tuple[list[float], dict[str, list[float]], list[bool]]:
        """:meth:`__call__` on the running event loop: ``async def`` functions awaited on it (so
        several batches scored at once share one judge's ``max_concurrency``), plain functions
        in its thread pool."""
        kwargs = self._arguments(prompts, completions, completion_ids, columns)
        loop = asyncio.get_running_loop()

        async def one(fn):
            try:
                if is_async_callable(fn):
                    return await fn(**kwargs)
                return await loop.run_in_executor(None, functools.partial(fn, **kwargs))
            except Exception as err:  # noqa: BLE001 - any failure of user code is reported the same way
                return err

        results = await asyncio.gather(*(one(fn) for _, _, fn in self.functions))
        return self._combine(dict(zip(self.names, results)), prompts, completions)

    def _arguments(self, prompts: list, completions: list, completion_ids: Optional[list[list[int]]],
                   columns: Optional[dict[str, list]]) -> dict[str, Any]:
        """The keyword arguments every function gets, checked (one entry per completion)."""
        n = len(completions)
        columns = dict(columns or {})
        clash = [key for key in RESERVED if key in columns]
        if clash:
            raise ConfigError(f"dataset column(s) {clash} clash with reward function arguments {list(RESERVED)}: rename them")
        if completion_ids is not None and "completion_lengths" not in columns:
            columns["completion_lengths"] = [len(ids) for ids in completion_ids]
        for name, values in [("prompts", prompts), ("completion_ids", completion_ids), *columns.items()]:
            if values is not None and len(values) != n:
                raise ConfigError(f"reward inputs disagree: {len(values)} {name} for {n} completions")
        if n and is_conversational(completions[0]):  # episodes: the messages after the prompt, as they are
            passed = list(completions)
        elif n and is_conversational(prompts[0]):
            passed = [[{"role": "assistant", "content": text}] for text in completions]
        else:
            passed = list(completions)
        return {"prompts": prompts, "completions": passed, "completion_ids": completion_ids, **columns}

    def _combine(self, raw: dict[str, Any], prompts: list, completions: list
                 ) -> tuple[list[float], dict[str, list[float]], list[bool]]:
        """Each function's checked scores, and their weighted sum per sample."""
        n = len(completions)
        total = [0.0] * n
        scored = [False] * n
        per_function = {}
        for name, weight, _ in self.functions:
            scores = self._check(name, raw[name], prompts, completions)
            per_function[name] = [math.nan if s is None else s for s in scores]
            for i, score in enumerate(scores):
                if score is not None:
                    total[i] += weight * score
                    # a weight-0 function is a monitor (logged, not trained on): its score alone would
                    # be a silent 0 where every trained function left the sample unscored
                    scored[i] = scored[i] or weight != 0
        return total, per_function, scored

    def _fail(self, name: str, message: str, count: int) -> list[float]:
        if self.on_error == "raise":
            raise RewardError(f"reward function {name!r}: {message}. Fix the function, or set "
                              f"model.on_reward_error=zero to score such samples 0 and count them.")
        self.error_counts[name] += count
        return [0.0] * count

    def _check(self, name: str, raw: Any, prompts: list, completions: list[str]) -> list[Optional[float]]:
        """The function's scores as floats or None, failures handled per ``on_error``."""
        n = len(completions)
        if isinstance(raw, BaseException):
            if not isinstance(raw, Exception):  # KeyboardInterrupt, SystemExit: not the function's failure
                raise raw
            if isinstance(raw, (RewardUnavailable, ConfigError)):  # the service is down, or a setting is wrong
                raise type(raw)(f"reward function {name!r}: {raw}") from raw
            first = prompts[0] if prompts else None
            return self._fail(name, f"raised {type(raw).__name__}: {raw} (batch of {n}, first prompt {first!r})", n)
        try:
            scores = [None if s is None else float(s) for s in raw]
        except (TypeError, ValueError) as err:
            return self._fail(name, f"returned something other than a list of numbers or None ({err})", n)
        if len(scores) != n:
            return self._fail(name, f"returned {len(scores)} scores for {n} completions", n)
        for i, score in enumerate(scores):
            if score is not None and not math.isfinite(score):
                if self.on_error == "raise":
                    self._fail(name, f"returned {score} for sample {i} (prompt {prompts[i]!r}, completion "
                                     f"{completions[i]!r}); return None for 'no score'", 1)
                self.error_counts[name] += 1
                scores[i] = 0.0
        return scores


def _callable_name(fn: Callable) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)
