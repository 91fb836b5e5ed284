"""OpenMP settings for a rollout server on a shared CPU, applied before torch starts.

OpenMP's default wait policy lets an idle thread spin a few ms before it sleeps. Beside a busy
process every parallel region then waits for a thread whose core the other process holds: 5-8x
slower steps on 2 cores. A rollout server's neighbour is a trainer by design (an asynchronous run
trains while the server generates), so ``gspo serve`` sets ``OMP_WAIT_POLICY=PASSIVE`` (idle
threads sleep at once). Training runs keep the default policy, faster when the cores are free,
and follow the load with their thread count instead (``run/cpu_threads.py``).

The OpenMP runtime reads these variables once, when torch loads it, so this must run before the
first ``import torch`` (``gspo_lightning/__init__.py`` imports torch lazily for that reason). A
value the user has set always wins.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

# command -> variable -> the value we set when the user has not set it
CPU_DEFAULTS = {"serve": {"OMP_WAIT_POLICY": "PASSIVE"}}


def configure_cpu_env(command: Optional[str], environ: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """Set ``command``'s :data:`CPU_DEFAULTS` in ``environ`` (``os.environ``) where unset; returns what it set."""
    environ = os.environ if environ is None else environ
    applied = {}
    for name, value in CPU_DEFAULTS.get(command or "", {}).items():
        if not environ.get(name):
            environ[name] = value
            applied[name] = value
    return applied


__all__ = ["CPU_DEFAULTS", "configure_cpu_env"]
