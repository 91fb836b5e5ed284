"""Scoring groups while the others still generate.

A group's rewards depend on its responses alone, so they can be computed as soon as its last
response ends, while the engine still decodes the longer ones. :class:`GroupScorer` takes each
finished group from the engine (``HFEngine.generate(on_group=...)``), decodes it, and starts the
reward functions on it at once on an event loop of its own: ``async def`` functions (an LLM
judge) wait on the network beside the decoding; plain functions run in the loop's threads. Every
group's requests share one judge's ``max_concurrency``. :meth:`GroupScorer.results` then waits
for the last groups and returns what :class:`~gspo_lightning.rewards.RewardComposer` would have
returned for the whole batch, in the batch's order: the same scores, only sooner.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from concurrent.futures import Future
from typing import Callable, Optional

from gspo_lightning.rewards.base import RewardComposer, close_long_lived, is_async_callable, mark_long_lived


def streams(engine, rewards: Optional[RewardComposer]) -> bool:
    """Whether to score group by group: the engine reports groups (its ``generate`` takes
    ``on_group``), and some reward function waits (``async def``: a judge, a remote reward model);
    plain Python ones would take the interpreter from the decoding."""
    reports = "on_group" in inspect.signature(engine.generate).parameters
    return reports and rewards is not None and any(is_async_callable(fn) for _, _, fn in rewards.functions)


class RewardLoop:
    """An event loop on a thread of its own, for the rollouts' scoring; lives with the worker."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        mark_long_lived(self.loop)  # a judge keeps its connections on it from step to step
        self.thread = threading.Thread(target=self.loop.run_forever, name="gspo-reward-loop", daemon=True)
        self.thread.start()

    def submit(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        if self.loop.is_running():
            try:  # the judges' sessions, closed on their loop
                self.submit(close_long_lived()).result(timeout=5)
            except Exception:  # noqa: BLE001 - closing: a session that will not close is dropped with the loop
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()


class GroupScorer:
    """One rollout's scoring, group by group (see the module docstring).

    Args:
        rewards: the run's reward functions.
        loop: where they run.
        decode: token ids -> text, as the batch path decodes completions.
        prompts: one per group (the batch's raw prompts: text or chat messages).
        columns: the batch's other columns, one entry per group.
        group_size: responses per group.
        errors_before: the composer's error count before this rollout (``on_reward_error: zero``).
    """

    def __init__(self, rewards: RewardComposer, loop: RewardLoop, decode: Callable[[list[list[int]]], list[str]],
                 prompts: list, columns: dict[str, list], group_size: int, errors_before: int = 0):
        self.rewards, self.loop, self.decode = rewards, loop, decode
        self.prompts, self.columns, self.group_size = prompts, columns, group_size
        self.errors_before = errors_before
        self.pending: dict[int, Future] = {}
        self.texts: dict[int, list[str]] = {}

    def submit(self, group: int, completion_ids: list[list[int]]) -> None:
        """Start scoring group ``group`` (called by the engine as the group ends)."""
        completions = self.decode(completion_ids)
        self.texts[group] = completions
        n = self.group_size
        columns = {key: [values[group]] * n for key, values in self.columns.items()}
        columns["completion_lengths"] = [len(ids) for ids in completion_ids]
        self.pending[group] = self.loop.submit(self.rewards.score_async(
            prompts=[self.prompts[group]] * n, completions=completions, completion_ids=completion_ids, columns=columns))

    def results(self) -> tuple[list[float], dict[str, list[float]], list[bool], list[str]]:
        """``(totals, components, scored, completions)`` of every group, in the batch's order."""
        total: list[float] = []
        scored: list[bool] = []
        components: dict[str, list[float]] = {name: [] for name in self.rewards.names}
        completions: list[str] = []
        for group in range(len(self.prompts)):
            try:
                group_total, group_components, group_scored = self.pending[group].result()
            except BaseException:  # a reward error: the rest of the step's scoring is moot
                self.cancel()
                raise
            total += group_total
            scored += group_scored
            for name, values in group_components.items():
                components[name] += values
            completions += self.texts[group]
        return total, components, scored, completions

    def cancel(self) -> None:
        for future in self.pending.values():
            future.cancel()
