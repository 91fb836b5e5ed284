"""OpenMP settings for shared CPUs, applied before torch starts.

OpenMP's default wait policy lets idle threads spin for a while before they sleep. On a
machine where another process is busy (a vLLM server beside the trainer, a test beside a
run, a laptop's background work) every parallel region then waits for a thread whose core
the other process holds: the quickstart went from 0.1 s to 8 s per step on 2 cores beside
one busy process. ``OMP_WAIT_POLICY=PASSIVE`` makes idle threads sleep at once, which
costs little on a quiet machine (``docs/reliability.md``, "CPU threads").

The OpenMP runtime reads these variables once, when torch loads it, so this must run
before the first ``import torch`` (``gspo_lightning/__init__.py`` imports torch lazily
for that reason). A value the user has set always wins.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

# variable -> the value we set when the user has not set it
CPU_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def configure_cpu_env(environ: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """Set :data:`CPU_DEFAULTS` in ``environ`` (``os.environ``) where unset; returns what it set."""
    environ = os.environ if environ is None else environ
    applied = {}
    for name, value in CPU_DEFAULTS.items():
        if not environ.get(name):
            environ[name] = value
            applied[name] = value
    return applied


__all__ = ["CPU_DEFAULTS", "configure_cpu_env"]
