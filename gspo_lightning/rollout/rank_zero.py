"""Engines that talk to servers from one training rank: rank 0 starts, pushes and reloads, and
every rank learns the outcome through :class:`RankZeroShare` (a broadcast that is also the
point where the other ranks wait for rank 0)."""

from __future__ import annotations

from typing import Any

import torch


class RankZeroShare:
    """Rank 0's values on every rank, over a process group of the engine's own.

    Pushes run on the producer thread when ``max_staleness >= 1``: their collective gets a
    gloo group of its own, so it never interleaves with the trainer's collectives (whose order
    it cannot know). With one rank, or no process group, :meth:`share` returns its argument.
    """

    def __init__(self) -> None:
        self._group = None

    def setup(self, world_size: int) -> None:
        """A collective: every rank calls it once, at the engine's start."""
        if world_size > 1 and self._group is None and torch.distributed.is_available() \
                and torch.distributed.is_initialized():
            self._group = torch.distributed.new_group(backend="gloo")

    def share(self, value: Any) -> Any:
        """``value`` of rank 0, on every rank (every rank calls it in the same order: from the
        producer thread or, while it is idle, the training thread)."""
        if self._group is not None:
            holder = [value]
            torch.distributed.broadcast_object_list(holder, src=0, group=self._group)
            return holder[0]
        return value


__all__ = ["RankZeroShare"]
