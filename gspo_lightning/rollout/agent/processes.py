"""Agents in processes of their own (``episodes.agent_processes: N``): each of N worker
processes runs many episodes at once on its own event loop, so the agents' Python (an HTTP
client, a framework, parsing) runs beside the trainer's endpoint and engine instead of taking
turns with them for one interpreter lock.

A worker is started with ``spawn`` (never ``fork``: the trainer holds threads), imports the
agent by its path, and answers ``("run", job, kwargs, timeout_s)`` with ``("ok", job, reward)``,
``("timeout", job, None)`` or ``("error", job, last traceback line)``; ``("cancel", job)`` cancels
an episode. A worker that dies fails its running episodes (counted as agent errors) and is
started again for the next rollout.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import multiprocessing
import threading
import traceback
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union


class AgentFailed(Exception):
    """An agent episode that raised in its worker process (the message: its last traceback line)."""


def check_result(result: Any) -> Union[None, float, dict[str, float]]:
    """The episode's reward from what the agent returned: a number, named numbers (the reward is
    their sum; each is logged as ``reward/<name>``), or None."""
    if isinstance(result, Mapping):
        bad = [name for name, value in result.items()
               if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float))]
        if bad or not result:
            raise TypeError(f"the agent returned {dict(result)!r:.80}; named rewards are a non-empty mapping of "
                            "names to numbers")
        return {name: float(value) for name, value in result.items()}
    if result is not None and (isinstance(result, bool) or not isinstance(result, (int, float))):
        raise TypeError(f"the agent returned {type(result).__name__} {result!r:.60}; return the episode's "
                        "reward as a float, named rewards ({name: float}), or None to have the reward functions score it")
    return None if result is None else float(result)


def quiet_about_open_clients(loop: asyncio.AbstractEventLoop) -> None:
    """An agents' event loop ends with the run (or its worker): clients the agents kept open for
    it (aiohttp's sessions, warning "Unclosed client session" when collected) end with it and
    need no warning; any other error on the loop is reported as before."""
    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if not str(context.get("message", "")).startswith(("Unclosed client session", "Unclosed connector")):
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


def _serve(conn, agent_path: str, threads: int) -> None:
    """A worker process: run the episodes it is sent, concurrently, until told to stop."""
    from gspo_lightning._imports import import_callable
    from gspo_lightning.rewards.base import is_async_callable

    agent = import_callable(agent_path, "agent")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    quiet_about_open_clients(loop)
    pool = None if is_async_callable(agent) else ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gspo-agent")
    tasks: dict[int, asyncio.Task] = {}
    sending = threading.Lock()

    def send(message: tuple) -> None:
        with sending:
            conn.send(message)

    async def episode(job: int, kwargs: dict, timeout_s: float) -> None:
        try:
            work = agent(**kwargs) if pool is None else loop.run_in_executor(pool, functools.partial(agent, **kwargs))
            send(("ok", job, check_result(await asyncio.wait_for(work, timeout_s))))
        except asyncio.TimeoutError:
            send(("timeout", job, None))
        except asyncio.CancelledError:
            pass  # the trainer no longer waits for it
        except Exception as err:  # noqa: BLE001 - user code: an unscored episode, counted and shown
            send(("error", job, traceback.format_exception_only(type(err), err)[-1].strip()))
        finally:
            tasks.pop(job, None)

    def start(job: int, kwargs: dict, timeout_s: float) -> None:
        tasks[job] = loop.create_task(episode(job, kwargs, timeout_s))

    def cancel(job: int) -> None:
        task = tasks.get(job)
        if task is not None:
            task.cancel()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the trainer is gone
                message = ("stop",)
            if message[0] == "run":
                loop.call_soon_threadsafe(start, *message[1:])
            elif message[0] == "cancel":
                loop.call_soon_threadsafe(cancel, message[1])
            else:
                loop.call_soon_threadsafe(loop.stop)
                return

    threading.Thread(target=read, name="gspo-agent-jobs", daemon=True).start()
    loop.run_forever()
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


class AgentProcesses:
    """``count`` worker processes running the agent at ``agent_path``; episodes are spread over
    them in turn. ``threads``: each worker's thread pool for a plain (not ``async``) agent."""

    def __init__(self, agent_path: str, count: int, threads: int = 64):
        self.agent_path, self.count, self.threads = agent_path, count, threads
        self._workers: list[Optional[_Worker]] = [None] * count
        self._jobs = itertools.count()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the workers that are not running (all at first; any that died since)."""
        for k, worker in enumerate(self._workers):
            if worker is None or not worker.alive:
                if worker is not None:
                    worker.close()
                self._workers[k] = _Worker(self.agent_path, self.threads)

    async def run(self, kwargs: dict, timeout_s: float) -> Union[None, float, dict[str, float]]:
        """One episode: its reward (None: the reward functions score it). Raises
        ``asyncio.TimeoutError`` past ``timeout_s``, :class:`AgentFailed` when it raised."""
        with self._lock:
            job = next(self._jobs)
        worker = self._workers[job % self.count]
        kind, value = await worker.submit(job, kwargs, timeout_s)
        if kind == "ok":
            return value
        if kind == "timeout":
            raise asyncio.TimeoutError
        raise AgentFailed(value)

    def close(self) -> None:
        for worker in self._workers:
            if worker is not None:
                worker.close()
        self._workers = [None] * self.count


class _Worker:
    """One worker process, its pipe, and the episodes waiting on it."""

    def __init__(self, agent_path: str, threads: int):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, agent_path, threads), name="gspo-agents", daemon=True)
        self.process.start()
        child.close()
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        self.alive = True
        threading.Thread(target=self._read, name="gspo-agent-results", daemon=True).start()

    async def submit(self, job: int, kwargs: dict, timeout_s: float) -> tuple[str, Any]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if not self.alive:
                return "error", self._exit_message()
            self._waiting[job] = (loop, future)
        try:
            self._send(("run", job, kwargs, timeout_s))
            return await future
        except asyncio.CancelledError:
            self._send(("cancel", job))
            raise
        finally:
            with self._lock:
                self._waiting.pop(job, None)

    def _send(self, message: tuple) -> None:
        try:
            with self._sending:
                self.conn.send(message)
        except (OSError, ValueError):  # the worker is gone: _read fails what waits on it
            pass

    def _read(self) -> None:
        while True:
            try:
                kind, job, value = self.conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                waiting = self._waiting.get(job)
            if waiting is not None:
                _settle(*waiting, (kind, value))
        self.process.join(timeout=5)
        with self._lock:
            self.alive = False
            waiting, self._waiting = list(self._waiting.values()), {}
        for loop, future in waiting:
            _settle(loop, future, ("error", self._exit_message()))

    def _exit_message(self) -> str:
        return f"the agent process exited (exit code {self.process.exitcode})"

    def close(self) -> None:
        self._send(("stop",))
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: tuple) -> None:
    def settle() -> None:
        if not future.done():
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass


__all__ = ["AgentFailed", "AgentProcesses", "check_result", "quiet_about_open_clients"]
