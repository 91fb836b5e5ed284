"""The lookup task's TRL class with a slow tool (bench_tool_concurrency.py): ``get`` takes
``BENCH_TOOL_SLEEP_S`` seconds (default 1), as a call to a remote service would."""

from __future__ import annotations

import os
import time

from gspo_lightning.data.tasks.lookup import LookupTable


class SlowLookupTable(LookupTable):
    def get(self, key: str) -> str:
        """Read the digit stored under a key of this episode's table.

        Args:
            key: One of the letters a to f.
        """
        time.sleep(float(os.environ.get("BENCH_TOOL_SLEEP_S", "1")))
        return super().get(key)
