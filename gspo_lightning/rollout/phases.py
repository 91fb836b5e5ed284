"""What the running step is doing, for the progress display: its phase (generating, log-probs,
update, evaluating), how far the phase got, and since when.

The training thread writes (``GSPOModule.training_step``, the HF engine's decode loop, the
progress bar's evaluation hooks); the display's own thread reads, once a second, to tick a bar
or print a line on a slow step (``run/progress.py``). The state lives here, in the lowest
folder that writes it (the engine's decode loop), so that rollout/ knows nothing of the run's
display and run/ reads it from below. Each write replaces one immutable
:class:`Phase`, so a reader never sees half an update. Writes from other threads (the
asynchronous rollout producer generating the next steps) are ignored: the display follows
the step the trainer waits on. Nothing here imports torch: it costs nothing when no display
reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Iterator, Optional


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str  # "generating", "log-probs", "update", "evaluating"
    started: float  # time.monotonic()
    done: int = 0
    total: Optional[int] = None
    unit: str = ""
    tokens: Optional[tuple[int, int]] = None  # generation: (tokens decoded, most tokens per response)

    def describe(self) -> str:
        """``generating 0/128 responses, token 12/32`` (what the bar and the lines show)."""
        text = self.name
        if self.total:
            text += f" {min(self.done, self.total)}/{self.total} {self.unit}".rstrip()
        if self.tokens is not None:
            text += f", token {self.tokens[0]}/{self.tokens[1]}"
        return text


class PhaseTracker:
    """The current phase of the trainer's thread (``None`` between phases)."""

    def __init__(self) -> None:
        self._phase: Optional[Phase] = None
        self._owner: Optional[int] = None
        self.changes = 0  # phases started so far: a reader tells a new phase from the same one

    @property
    def current(self) -> Optional[Phase]:
        return self._phase

    def begin(self, name: str, total: Optional[int] = None, unit: str = "") -> Optional[Phase]:
        """Start a phase; returns the one it interrupts, for :meth:`end`."""
        outer = self._mine()
        self._owner = threading.get_ident()
        self._phase = Phase(name, time.monotonic(), total=total, unit=unit)
        self.changes += 1
        return outer

    def end(self, outer: Optional[Phase] = None) -> None:
        if self._owner == threading.get_ident():
            self._phase = outer  # evaluation's generation sits inside "evaluating": back to it

    @contextlib.contextmanager
    def phase(self, name: str, total: Optional[int] = None, unit: str = "") -> Iterator[None]:
        outer = self.begin(name, total, unit)
        try:
            yield
        finally:
            self.end(outer)

    def begin_update(self, settings, num_responses: int) -> None:
        """The update phase of a step: ``ppo_epochs`` x mini-batches optimizer steps (``UpdateSettings``)."""
        batches = -(-num_responses // settings.mini_batch_size)  # the last mini-batch may be short
        self.begin("update", total=settings.ppo_epochs * batches, unit="optimizer steps")

    def _mine(self) -> Optional[Phase]:
        phase = self._phase
        return phase if phase is not None and self._owner == threading.get_ident() else None

    def advance(self, n: int = 1) -> None:
        phase = self._mine()
        if phase is not None:
            self._phase = dataclasses.replace(phase, done=phase.done + n)

    def tokens(self, decoded: int, most: int) -> None:
        phase = self._mine()
        if phase is not None:
            self._phase = dataclasses.replace(phase, tokens=(decoded, most))


PHASES = PhaseTracker()  # the process's trainer: one fit at a time per process

__all__ = ["PHASES", "Phase", "PhaseTracker"]
