"""Tools that run side by side: every live episode's environment steps at once, bounded by
``model.episodes.max_concurrent_tools``; ``async def`` tools are awaited (and cancelled at their
timeout); hung plain tools never pile up threads without bound."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from gspo_lightning.episodes import Environment, StepResult, Tool, ToolEnvironment
from gspo_lightning.episodes.loop import EpisodeLoop
from gspo_lightning.rollout.episodes import step_environments

running = {"now": 0, "peak": 0}
lock = threading.Lock()


def _enter():
    with lock:
        running["now"] += 1
        running["peak"] = max(running["peak"], running["now"])


def _leave():
    with lock:
        running["now"] -= 1


def slow_lookup(key: str) -> str:
    """Look a key up in a slow service (one second).

    Args:
        key: The key.
    """
    _enter()
    try:
        time.sleep(1.0)
        return key.upper()
    finally:
        _leave()


async def async_lookup(key: str) -> str:
    """Look a key up in a slow asynchronous service (one second).

    Args:
        key: The key.
    """
    _enter()
    try:
        await asyncio.sleep(1.0)
        return key.upper()
    finally:
        _leave()


def call(name: str, **arguments) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def turn(*calls: str) -> dict:
    return {"role": "assistant", "content": "\n".join(calls)}


@pytest.fixture(autouse=True)
def reset_counts():
    running.update(now=0, peak=0)


@pytest.mark.parametrize("tool", [slow_lookup, async_lookup], ids=["plain", "async"])
def test_a_turn_of_many_episodes_with_a_one_second_tool_costs_about_one_call(tool):
    template = ToolEnvironment([tool], timeout_s=5.0)
    episodes = [template.fresh() for _ in range(128)]
    start = time.perf_counter()
    results = step_environments(EpisodeLoop(256), episodes, [turn(call(tool.__name__, key=f"k{i}")) for i in range(128)])
    elapsed = time.perf_counter() - start
    # one after another this was 128 s; side by side it is one call and the overhead
    assert elapsed < 4.0, elapsed
    assert [r.messages[0]["content"] for r in results] == [f"K{i}" for i in range(128)]  # each its own reply, in order
    assert running["peak"] == 128


def test_max_concurrent_tools_bounds_the_calls_running_at_once():
    template = ToolEnvironment([async_lookup, slow_lookup], timeout_s=5.0)
    episodes = [template.fresh() for _ in range(12)]
    messages = [turn(call("async_lookup" if i % 2 else "slow_lookup", key="x")) for i in range(12)]
    start = time.perf_counter()
    results = step_environments(EpisodeLoop(4), episodes, messages)
    elapsed = time.perf_counter() - start
    assert running["peak"] == 4  # plain and async calls share the bound
    assert 2.9 < elapsed < 6.0, elapsed  # 12 calls of 1 s, 4 at a time: 3 rounds
    assert all(r.messages[0]["content"] == "X" for r in results)


def test_parallel_calls_run_one_turns_calls_together_and_keep_their_order():
    message = turn(call("slow_lookup", key="a"), call("async_lookup", key="b"), call("slow_lookup", key="c"))
    for parallel, lowest, highest in [(True, 0.9, 1.9), (False, 2.9, 4.5)]:
        environment = ToolEnvironment([slow_lookup, async_lookup], timeout_s=5.0, parallel_calls=parallel)
        start = time.perf_counter()
        result = step_environments(EpisodeLoop(8), [environment.fresh()], [message])[0]
        assert lowest < time.perf_counter() - start < highest, parallel
        assert [m["content"] for m in result.messages] == ["A", "B", "C"]


def test_an_async_tool_is_cancelled_at_its_timeout():
    stopped = []

    async def stuck(seconds: int) -> str:
        """Wait.

        Args:
            seconds: How long.
        """
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            stopped.append(True)
            raise
        return "late"

    environment = ToolEnvironment([stuck], timeout_s=0.2)
    start = time.perf_counter()
    result = step_environments(EpisodeLoop(4), [environment], [turn(call("stuck", seconds=30))])[0]
    assert time.perf_counter() - start < 2.0
    assert result.messages[0]["content"] == "Error: stuck timed out after 0.2 s"
    assert result.info["tool_timeouts"] == 1 and stopped == [True]  # not left running


def test_hung_plain_calls_are_bounded_and_the_bound_frees_when_they_return():
    release = threading.Event()

    def hangs(x: int) -> int:
        """Hang until released.

        Args:
            x: A number.
        """
        release.wait(30)
        return x

    tool = Tool(hangs, max_hung=2)
    threads_before = threading.active_count()
    for _ in range(2):
        with pytest.raises(Exception, match="timed out after 0.1 s"):
            tool({"x": 1}, timeout_s=0.1)
    start = time.perf_counter()
    for _ in range(5):  # refused at once, no thread started
        with pytest.raises(Exception, match="hangs was not run: 2 earlier calls are still running past their timeout"):
            tool({"x": 1}, timeout_s=0.1)
    assert time.perf_counter() - start < 0.5
    assert threading.active_count() - threads_before == 2
    release.set()
    deadline = time.monotonic() + 5
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tool({"x": 7}, timeout_s=1.0) == "7"  # the hung calls returned: the tool runs again
    # another episode's copy of the tool counts the same hung calls
    assert tool.bound_to(hangs)._hung is tool._hung


class SlowGuess(Environment):
    """An environment with a plain step() that takes a while (a sandbox, a simulator)."""

    def step(self, assistant_message: dict) -> StepResult:
        time.sleep(0.5)
        if assistant_message["content"] == "boom":
            raise ValueError("the simulator crashed")
        return StepResult(messages=[{"role": "user", "content": "again"}])


def test_plain_step_methods_run_in_threads_side_by_side_and_a_failure_stays_with_its_episode():
    environments = [SlowGuess() for _ in range(16)]
    messages = [{"role": "assistant", "content": "boom" if i == 3 else "5"} for i in range(16)]
    start = time.perf_counter()
    results = step_environments(EpisodeLoop(16), environments, messages)
    assert time.perf_counter() - start < 3.0  # 8 s one after another
    assert isinstance(results[3], ValueError)
    assert all(isinstance(r, StepResult) for i, r in enumerate(results) if i != 3)


class Connected(Environment):
    """An environment that opens something bound to the event loop in areset (an OpenEnv client's
    WebSocket is one) and uses it at every later turn."""

    async def areset(self, row: dict, prompt: list[dict]) -> list[dict]:
        self.loop, self.sent = asyncio.get_running_loop(), asyncio.Queue()
        return prompt

    async def astep(self, assistant_message: dict) -> StepResult:
        assert asyncio.get_running_loop() is self.loop  # the loop it connected on
        await self.sent.put(assistant_message["content"])
        return StepResult(messages=[{"role": "user", "content": "more"}])

    async def afinish(self) -> dict[str, float]:
        return {"sent": float(self.sent.qsize())}


def test_what_an_environment_opens_in_areset_serves_it_for_every_turn():
    loop = EpisodeLoop(8)
    environments = [Connected() for _ in range(4)]
    loop.gather(lambda e=e: e.areset({}, []) for e in environments)
    for _ in range(3):  # three turns
        results = step_environments(loop, environments, [{"role": "assistant", "content": "x"}] * 4)
        assert all(isinstance(r, StepResult) for r in results), results
    assert loop.gather(e.afinish for e in environments) == [{"sent": 3.0}] * 4


class WhereStepped(Environment):
    def step(self, assistant_message: dict) -> StepResult:
        return StepResult(messages=[], info={"thread": threading.current_thread().name})


class WhereSteppedQuick(WhereStepped):
    blocking = False


def test_plain_methods_run_in_threads_unless_the_environment_says_they_never_wait():
    loop = EpisodeLoop(4)
    message = {"role": "assistant", "content": "x"}
    slow, quick = step_environments(loop, [WhereStepped(), WhereSteppedQuick()], [message, message])
    assert slow.info["thread"].startswith("environment")  # the loop's pool: a step may wait on I/O
    assert quick.info["thread"] == "episode-loop"  # blocking = False: on the loop, no thread per call
    assert loop.gather([WhereStepped().afinish]) == [{}]  # no rewards(): nothing to run
