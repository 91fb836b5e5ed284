"""A stop asked from outside the run (SIGTERM, Ctrl-C): the rollout gives up the step it is
generating, whose samples would be thrown away, instead of finishing it first.

``run/preemption.py`` asks (:func:`request`) and clears the request when a fit starts; the loops
that generate look (:func:`check`) at each decoded token, turn and batch of agent calls, in
whichever thread they run (the asynchronous producer's too). The trainer's own thread is
stopped by the signal handler itself, wherever it waits."""

from __future__ import annotations

import threading


class GenerationStopped(BaseException):
    """The rollout gave up its step because the run is stopping (a ``BaseException``: no
    ``except Exception`` on the way takes it for a failure of the step)."""


_requested = threading.Event()


def request() -> None:
    _requested.set()


def clear() -> None:
    _requested.clear()


def requested() -> bool:
    return _requested.is_set()


def check() -> None:
    """Raise :class:`GenerationStopped` once a stop was asked."""
    if _requested.is_set():
        raise GenerationStopped("the run is stopping: this step's generation was abandoned")


__all__ = ["GenerationStopped", "check", "clear", "request", "requested"]
