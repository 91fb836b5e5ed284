"""The event loop every environment call of a run runs on.

Episodes of a rollout are reset, stepped and finished side by side: the runner gathers the
environments' ``areset`` / ``astep`` / ``afinish`` coroutines on one asyncio loop, which lives in
a daemon thread for the whole run. One loop for the run, not one per turn, because an environment
may hold a connection that belongs to the loop it was opened on (an OpenEnv client's WebSocket to
its server). Plain (synchronous) environment methods run in the loop's thread pool, and at most
``max_concurrent_tools`` tool calls run at once (:data:`~gspo_lightning.episodes.tools.tool_slots`).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Iterable

from gspo_lightning.episodes.tools import tool_slots


class EpisodeLoop:
    """An asyncio loop in a daemon thread, started on first use.

    Args:
        max_concurrent_tools: tool calls running at once, and threads for plain methods.
    """

    def __init__(self, max_concurrent_tools: int):
        self.max_concurrent_tools = max_concurrent_tools
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._lock = threading.Lock()

    # a run's settings are copied and pickled (checkpoints, worker processes): the thread is not
    def __getstate__(self) -> dict:
        return {"max_concurrent_tools": self.max_concurrent_tools}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_concurrent_tools"])

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                loop.set_default_executor(ThreadPoolExecutor(self.max_concurrent_tools,
                                                             thread_name_prefix="environment"))
                threading.Thread(target=loop.run_forever, name="episode-loop", daemon=True).start()
                self._slots = asyncio.run_coroutine_threadsafe(self._make_slots(), loop).result()
                self._loop = loop
            return self._loop

    async def _make_slots(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.max_concurrent_tools)

    def gather(self, calls: Iterable[Callable[[], Awaitable[Any]]]) -> list[Any]:
        """Each call's awaited result, all side by side on the loop: what it returned, or the
        exception it raised (in the calls' order)."""
        loop = self._start()
        calls = list(calls)
        if not calls:
            return []

        async def main() -> list[Any]:
            tool_slots.set(self._slots)  # the tasks gather makes copy this context
            return await asyncio.gather(*(call() for call in calls), return_exceptions=True)

        return asyncio.run_coroutine_threadsafe(main(), loop).result()


__all__ = ["EpisodeLoop"]
