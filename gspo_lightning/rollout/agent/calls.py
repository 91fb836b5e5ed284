"""Calls waiting for the engine, handed from the endpoint's event loop to the thread that owns
the engine (the rollout's), and batched there: calls that arrive together are one generation.

A batch is taken when every running agent is waiting on a call, or ``window_s`` after the
oldest waiting call arrived (an agent busy in a slow tool does not hold the others back). With
``window_s=None`` a batch waits for every running agent: each batch is then the next call of
every live episode, and (sorted by episode, as every batch is) the same in every run of
agents that act alike, so sampling is reproducible (a resumed run samples as the straight one).
Such a batch is taken short when no call arrived for ``stall_s`` (an agent's client whose
connection pool holds fewer connections than episodes run at once cannot send them all):
counted in ``stalls``, the run says so once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class QueuedCall:
    """A call's prompt and room, and where its result goes (a future on the endpoint's loop)."""

    prompt_ids: list[int]
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    episode: int = 0  # the episode's index in the rollout: a batch's rows are in this order
    arrived: float = field(default_factory=time.monotonic)

    def resolve(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        def settle() -> None:
            if self.future.done():  # the call was cancelled (its client went away)
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(settle)


class CallQueue:
    """Thread-safe: the endpoint submits, the rollout thread takes batches."""

    # 5 s: a call is late by seconds on a loaded machine (agents in worker processes beside other
    # runs); a full client pool stalls every batch, so it is said either way
    def __init__(self, window_s: Optional[float] = 0.05, stall_s: float = 5.0):
        self.window_s = window_s
        self.stall_s = stall_s
        self.stalls = 0  # reproducible batches taken short: nothing arrived for stall_s
        self._cond = threading.Condition()
        self._pending: list[QueuedCall] = []
        self._remaining = 0  # agents not yet ended
        self._concurrent = 0  # agents that run at once

    def reset(self, agents: int, concurrent: Optional[int] = None) -> None:
        with self._cond:
            self._pending.clear()
            self._remaining = agents
            self._concurrent = concurrent or agents
            self.stalls = 0

    @property
    def _running(self) -> int:
        """Agents running or about to (the rest wait for a free slot of ``max_concurrent``)."""
        return min(self._remaining, self._concurrent)

    def submit(self, call: QueuedCall) -> None:
        with self._cond:
            self._pending.append(call)
            self._cond.notify_all()

    def agent_finished(self) -> None:
        with self._cond:
            self._remaining -= 1
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        """Every agent ended and no call waits."""
        with self._cond:
            return self._remaining <= 0 and not self._pending

    def take(self, poll_s: float = 0.05) -> list[QueuedCall]:
        """The next batch, or ``[]`` after ``poll_s`` with nothing waiting (or when all agents ended)."""
        with self._cond:
            if not self._pending and self._remaining > 0:
                self._cond.wait(poll_s)
            if not self._pending:
                return []
            if self.window_s is None:  # every running agent's call: reproducible batches
                while len(self._pending) < self._running:
                    if not self._cond.wait(self.stall_s):  # an agent that cannot call (its client's pool is full)
                        self.stalls += 1
                        break
            else:
                deadline = self._pending[0].arrived + self.window_s
                while len(self._pending) < self._running and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
            batch, self._pending = sorted(self._pending, key=lambda call: call.episode), []
            return batch

    def fail_pending(self, error: BaseException) -> None:
        with self._cond:
            batch, self._pending = self._pending, []
        for call in batch:
            call.resolve(error=error)


__all__ = ["CallQueue", "QueuedCall"]
