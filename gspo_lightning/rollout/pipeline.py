"""Rollouts generated ahead, on a background thread, with bounded staleness.

With ``max_staleness: k >= 1`` the rollouts of the next ``k`` steps are generated while the
current step trains. The unit of staleness is the **rollout step** (one prompt batch, one
``training_step``): a rollout sampled with the weights the policy had at the start of
step ``s`` and trained on at step ``t`` has a lag of ``t - s``. The lag in optimizer steps
(``policy_version``) is ``num_mini_batches x ppo_epochs`` times that and is logged too.

The schedule is fixed, so a run is reproducible and resumable bit for bit on a
deterministic engine. At the start of step ``t``:

1. wait until the producer is idle (an engine must not receive weights mid-generation);
2. copy the policy's weights (version of step ``t``) to host memory;
3. submit the batches of steps ``t .. t + k`` not yet submitted, in order (batch ``t + k``
   in steady state; all of them on the first step, which waits for its own); the producer
   first sends the copy to the engine, then generates;
4. take step ``t``'s rollout: sampled at step ``t - k`` (lag ``k``; less in the first steps).

Step ``t``'s training then overlaps the weight push and the generation of batch ``t + k``:
only the copy stays on the step's path. A rollout whose lag
exceeds ``k`` (after a resume with a smaller ``k``, or from an engine that reports older
weights) is never silently used or dropped: ``regenerate`` samples it again with the
current weights, ``reweight`` keeps it for the off-policy correction; both are counted.

A checkpoint holds the rollouts generated but not trained on (after draining the one in
flight), so a resumed run trains on exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch

from gspo_lightning.errors import ConfigError
from gspo_lightning.rollout.worker import Rollout

StaleRollouts = Literal["regenerate", "reweight"]


class NotGenerated(RuntimeError):
    """A queued batch the producer skipped because an earlier generation failed."""


@dataclass
class PendingRollout:
    index: int  # its prompt batch's index in the prompt stream (the step that trains on it, unless a failed step skipped one)
    sampled_at: int  # the rollout step whose weights sampled it
    prompt_ids: list[list[int]]
    future: Future


WeightsCapture = Callable[[], tuple[Optional[Callable[[], dict[str, float]]], dict[str, float]]]


class RolloutPipeline:
    """The producer (one background thread) and the queue of rollouts it made.

    Rollouts are keyed by their prompt batch's index in the stream (``batch["index"]``, set
    by the data module; the step number when absent), which is the step number except after
    a failed step, whose batch the resumed run skips as the synchronous loop does.

    Args:
        generate: ``generate(batch, index) -> Rollout``, the worker's rollout of a batch with
            the seed of ``index``, run on the producer thread with the engine's current weights.
        batch_at: ``batch_at(index) -> batch``, a future prompt batch.
        max_staleness: ``k >= 1``, the largest lag (in rollout steps) a rollout may have.
        stale_rollouts: what to do with a rollout beyond ``k``: ``regenerate`` or ``reweight``.
        gather: ``gather(value)``, every rank's ``value`` in rank order (a collective, called on
            the training thread once per step): ranks stop on the same step when one rank's
            rollout failed. ``[value]`` on one process.

    A failed generation is raised by the step that trains on it, never earlier: the batches
    before it that finished are trained on (and checkpointed), as the synchronous loop
    would. After a failure the producer generates nothing more (the queued jobs fail at
    once, without touching the engine), so stopping does not wait out an engine's timeouts
    once per queued batch; those batches are sampled again by the resumed run.
    """

    def __init__(self, generate: Callable[[dict, int], Rollout], batch_at: Callable[[int], dict], max_staleness: int,
                 stale_rollouts: StaleRollouts = "regenerate", gather: Callable[[Any], list] = lambda value: [value]):
        if max_staleness < 1:
            raise ConfigError(f"RolloutPipeline needs max_staleness >= 1, got {max_staleness}")
        if stale_rollouts not in ("regenerate", "reweight"):
            raise ConfigError(f"stale_rollouts must be regenerate or reweight, got {stale_rollouts!r}")
        self.generate, self.batch_at = generate, batch_at
        self.max_staleness, self.stale_rollouts = max_staleness, stale_rollouts
        self.gather = gather
        self.pending: dict[int, PendingRollout] = {}
        self.executor: Optional[ThreadPoolExecutor] = None
        self.failed: Optional[int] = None  # the first batch whose generation failed
        self.step_versions: dict[int, int] = {}  # rollout step -> the policy version captured at its start

    def _executor(self) -> ThreadPoolExecutor:
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-producer")
        return self.executor

    def _run(self, batch: dict, step: int, push: Optional[Callable[[], dict[str, float]]] = None) -> Future:
        def job() -> Rollout:
            if self.failed is not None:  # the engine (or a reward) failed on an earlier batch: stop at once
                raise NotGenerated(f"prompt batch {step} was not generated: the generation of batch {self.failed} failed")
            try:
                timings = push() if push is not None else {}  # the weights first: the producer runs jobs in order
                rollout = self.generate(batch, step)
            except BaseException:
                self.failed = step
                raise
            rollout.timings.update(timings)
            return rollout
        return self._executor().submit(job)

    def _submit(self, index: int, sampled_at: int, batch: dict, push: Optional[Callable[[], dict[str, float]]]) -> None:
        future = self._run(batch, index, push)
        self.pending[index] = PendingRollout(index, sampled_at, [list(p) for p in batch["prompt_ids"]], future)

    def drain(self) -> float:
        """Wait until the producer is idle; returns the seconds waited. A failed generation is
        not raised here but by the step that trains on its batch (the batches before it are trained)."""
        start = time.perf_counter()
        for pending in list(self.pending.values()):
            pending.future.exception()  # waits, without raising
        return time.perf_counter() - start

    def _agree(self, index: int, future: Future, lag: int = 0) -> int:
        """The ranks' common view of step ``index``'s rollout (:func:`agree`); the largest
        ``lag`` over ranks, so all decide the window alike."""
        return max(agree(self.gather, index, future.exception(), lag))

    def next(self, step: int, batch: dict, capture_weights: WeightsCapture,
             version: Optional[int] = None) -> tuple[Rollout, dict[str, float]]:
        """Step ``step``'s rollout (``batch`` is that step's prompts, as the loader gave them)
        and the pipeline's metrics for the step.

        ``capture_weights() -> (push, timings)`` copies the policy's current weights and
        returns the push that sends the copy (``None``: the engine has them already), as
        :meth:`RolloutWorker.capture_weights` does; the producer runs the push. ``version``:
        the policy version captured (what the engine reports after the push); with it the
        lag counts the version the engine reports it sampled with, not only the schedule."""
        index = int(batch.get("index", step))
        waited = self.drain()
        push, timings = capture_weights()
        if version is not None:
            self.step_versions[step] = version
            for old in [s for s in self.step_versions if s < step - 4 * self.max_staleness - 4]:
                del self.step_versions[old]
        for skipped in [i for i in self.pending if i < index]:  # batches a failed step consumed
            del self.pending[skipped]
        for ahead in range(index, index + self.max_staleness + 1):
            if ahead not in self.pending:
                self._submit(ahead, step, batch if ahead == index else self.batch_at(ahead), push)
                push = None
        if push is not None:  # nothing new to generate (all queued already): the engine still gets the weights
            self._executor().submit(push).result()
        pending = self.pending.pop(index)
        start = time.perf_counter()
        pending.future.exception()  # waits, without raising
        waited += time.perf_counter() - start
        done = pending.future.exception() is None
        sampled_at = self._sampled_at(pending.sampled_at, pending.future.result().policy_version) if done else pending.sampled_at
        lag = self._agree(index, pending.future, step - sampled_at)
        rollout = pending.future.result()
        if pending.prompt_ids != [list(p) for p in batch["prompt_ids"]]:
            raise RuntimeError(f"the rollout queued for prompt batch {index} answers other prompts than the loader's "
                               f"batch {index}: the prompt stream and the pipeline are out of step")
        stats = {"async/lag": float(lag), "async/out_of_window": 0.0, "async/regenerated": 0.0}
        if lag > self.max_staleness:
            stats["async/out_of_window"] = 1.0
            if self.stale_rollouts == "regenerate":
                self.drain()  # the engine holds this step's weights; the queued batches go first
                future = self._run(batch, index)  # the engine got this step's weights above
                future.exception()
                self._agree(index, future)
                rollout = future.result()
                stats["async/regenerated"] = 1.0
                stats["async/lag"] = 0.0
        stats["time/wait_rollout"] = waited
        stats.update(timings)
        return rollout, stats

    def _sampled_at(self, scheduled: int, reported: int) -> int:
        """The step whose weights sampled a rollout: the scheduled one when the engine reports its
        version (or versions are not known), else the last step whose weights the engine reports
        (an engine that fell behind: the lag, and the window, see it)."""
        if self.step_versions.get(scheduled, reported) == reported:
            return scheduled
        steps = [s for s, v in self.step_versions.items() if v == reported]
        return max(steps) if steps else scheduled

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The rollouts generated but not trained on (the one in flight is waited for). One
        whose generation failed (a reward function raised: the run is stopping with a
        checkpoint) is left out; a resumed run generates it again with its current weights."""
        for pending in self.pending.values():
            pending.future.exception()  # waits, without raising
        done = [p for p in sorted(self.pending.values(), key=lambda p: p.index) if p.future.exception() is None]
        return {"pending": [
            {"index": p.index, "sampled_at": p.sampled_at, "prompt_ids": p.prompt_ids,
             "rollout": rollout_to_dict(p.future.result())}
            for p in done
        ], "step_versions": [[step, version] for step, version in sorted(self.step_versions.items())]}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.pending = {}
        self.step_versions = {int(step): int(version) for step, version in state.get("step_versions", [])}
        for item in state.get("pending", []):
            future: Future = Future()
            future.set_result(rollout_from_dict(item["rollout"], device))
            self.pending[item["index"]] = PendingRollout(item["index"], item["sampled_at"], item["prompt_ids"], future)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None


def agree(gather: Callable[[Any], list], index: int, error: Optional[BaseException], value: Any = None) -> list:
    """Every rank's ``value`` for prompt batch ``index``'s rollout (a collective), or raise on every
    rank when it failed on one: a rank that went on alone would wait in the update's collectives.
    The failed rank raises its own error, the others one of the same class naming the rank, so
    every rank stops on the same step and writes the same checkpoint."""
    outcomes = gather((None if error is None else (type(error), str(error)), value))
    if error is not None:
        raise error
    failed = [(rank, outcome) for rank, (outcome, _) in enumerate(outcomes) if outcome is not None]
    if failed:
        rank, (kind, message) = failed[0]
        try:
            raised = kind(f"the rollout of prompt batch {index} failed on rank {rank}: {message}")
        except Exception:  # noqa: BLE001 - an exception class with another signature
            raised = RuntimeError(f"the rollout of prompt batch {index} failed on rank {rank}: {kind.__name__}: {message}")
        raise raised
    return [value for _, value in outcomes]


def rollout_to_dict(rollout: Rollout) -> dict[str, Any]:
    """A rollout as plain containers and CPU tensors (loadable with ``weights_only=True``)."""
    def plain(value):
        if torch.is_tensor(value):
            return value.detach().cpu()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):  # a vision rollout's images: one dict of tensors (or None) per row
            return [plain(v) for v in value]
        return value
    return {f.name: plain(getattr(rollout, f.name)) for f in dataclasses.fields(rollout)}


def rollout_from_dict(state: dict[str, Any], device: torch.device) -> Rollout:
    def on_device(value):
        if torch.is_tensor(value):
            return value.to(device)
        if isinstance(value, dict):
            return {k: on_device(v) for k, v in value.items()}
        return value
    return Rollout(**{k: on_device(v) for k, v in state.items()})


__all__ = ["NotGenerated", "PendingRollout", "RolloutPipeline", "StaleRollouts", "WeightsCapture", "rollout_from_dict", "rollout_to_dict"]
