"""Environments: what answers the model between its turns.

An episode is: ``reset(row, prompt)`` (the conversation it starts from: the row's prompt
messages, with whatever the environment puts before or after them), then for each
assistant turn ``step(assistant_message) -> StepResult`` until the result is ``done``, the
model makes no call, or the runner's ``max_turns`` / token budget ends it.

One instance serves one episode. A config names a template instance (``class_path`` and
``init_args`` of plain types, tools as import paths); the runner calls ``template.fresh()``
per episode, so an environment with per-episode state (a game board, a sandbox) starts
clean each time. ``fresh()`` deep-copies by default; override it when something should be
shared between episodes (a connection pool, loaded tools) or is costly to copy.

.. code-block:: yaml

    environment:
      class_path: gspo_lightning.episodes.ToolEnvironment
      init_args:
        tools: [my_tools.add, my_tools.multiply]
        timeout_s: 2.0
"""

from __future__ import annotations

import asyncio
import copy
from typing import Callable, Optional, Union

from gspo_lightning.episodes.messages import StepResult
from gspo_lightning.episodes.parsers import HermesToolCallParser, ToolCallParser
from gspo_lightning.episodes.tools import Tool, ToolError, load_tools
from gspo_lightning.errors import ConfigError


class Environment:
    """Base environment: subclasses implement :meth:`step`, and :meth:`reset` when they add messages."""

    # True when the environment's own rewards (turn rewards, :meth:`rewards`) may be an episode's
    # only reward: the run then needs no reward functions
    scores_episodes: bool = False
    # False: reset, step and rewards never wait (no I/O, no sleep): the runner calls them on its
    # event loop instead of in a thread each (a thread costs ~0.1 ms a call, ~50 ms a turn of 512)
    blocking: bool = True

    @property
    def tools_schema(self) -> Optional[list[dict]]:
        """The function schemas the model is shown (the chat template's ``tools=``), or None."""
        return None

    def fresh(self) -> "Environment":
        """A new instance for one episode, in the state ``__init__`` left it."""
        return copy.deepcopy(self)

    def reset(self, row: dict, prompt: list[dict]) -> list[dict]:
        """Start an episode on a dataset row (all its columns) whose prompt is ``prompt`` (chat
        messages); returns the conversation the first assistant turn answers. The default: the
        prompt as it is. Override to add a system message, a worked example, a first observation."""
        return list(prompt)

    def step(self, assistant_message: dict) -> StepResult:
        """Answer one assistant turn ``{"role": "assistant", "content": text}``."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(assistant_message) -> StepResult")

    def rewards(self) -> dict[str, float]:
        """Named rewards of the finished episode, each added to its reward and logged as
        ``reward/<name>`` (an environment that scores episodes itself); default none."""
        return {}

    # How the episode runner calls the three, every episode's at once on the run's event loop
    # (episodes/loop.py). The defaults run the plain methods in its thread pool; override them to
    # await instead (async tools, an environment behind a connection opened in areset).
    async def areset(self, row: dict, prompt: list[dict]) -> list[dict]:
        """:meth:`reset`, awaited."""
        if not self.blocking:
            return self.reset(row, prompt)
        return await asyncio.to_thread(self.reset, row, prompt)

    async def astep(self, assistant_message: dict) -> StepResult:
        """:meth:`step`, awaited."""
        if not self.blocking:
            return self.step(assistant_message)
        return await asyncio.to_thread(self.step, assistant_message)

    async def afinish(self) -> dict[str, float]:
        """Once, when the episode has ended: :meth:`rewards`; override to also release what the
        episode holds (a connection, a sandbox)."""
        if type(self).rewards is Environment.rewards:  # none: no thread for nothing
            return {}
        if not self.blocking:
            return self.rewards()
        return await asyncio.to_thread(self.rewards)

    def for_rewards(self) -> object:
        """What reward functions get for this episode in ``environments=`` (default: the environment)."""
        return self


class ToolEnvironment(Environment):
    """Runs the tool calls of each assistant turn and replies with one ``tool`` message per call.

    Only the text after a turn's last ``</think>`` is read for calls (a call drafted while reasoning
    is not made). The episode is done when a turn makes no call and no malformed call (a malformed call gets
    an error reply, so the model may retry). A turn's calls run one after another in the order
    written, or side by side with ``parallel_calls`` (the replies keep that order either way); a
    turn's unreadable calls are answered after its readable ones. Every fault is a reply
    ``"Error: ..."`` and is counted in ``StepResult.info``: ``tool_calls`` (all calls, readable
    or not), ``tool_errors`` (calls answered with an error), ``tool_timeouts``,
    ``malformed_tool_calls``.

    Args:
        tools: import paths (``package.module.function``) or callables; see ``episodes/tools.py``.
        parser: reads the calls from the turn's text; default :class:`HermesToolCallParser`.
        timeout_s: the longest one call may run before its reply is a timeout error.
        max_calls_per_turn: calls past this many in one turn are not run; each gets an error reply.
        first_messages: messages every conversation starts with, before the row's prompt: a system
            message, a worked example of a call (a small model that has never seen the call format
            in its chat template learns it from one example).
        parallel_calls: run a turn's calls side by side (tools that do not depend on each other's
            effects); off: in the order written.
        max_hung_calls: calls of one tool that may still be running past their timeout (each holds
            a thread) before its next calls are answered with an error.
        error_reply: the reply to a failed call, ``{error}`` replaced by the reason (a tiny model's
            vocabulary may need a single word, e.g. ``error``).
    """

    def __init__(self, tools: list[Union[str, Callable]], parser: Optional[ToolCallParser] = None,
                 timeout_s: float = 5.0, max_calls_per_turn: int = 4, first_messages: Optional[list[dict]] = None,
                 parallel_calls: bool = False, max_hung_calls: int = 8, error_reply: str = "Error: {error}"):
        if timeout_s <= 0:
            raise ConfigError(f"model.episodes.environment.init_args.timeout_s must be positive, got {timeout_s}")
        if max_calls_per_turn < 1:
            raise ConfigError(f"model.episodes.environment.init_args.max_calls_per_turn must be at least 1, got {max_calls_per_turn}")
        if max_hung_calls < 1:
            raise ConfigError(f"model.episodes.environment.init_args.max_hung_calls must be at least 1, got {max_hung_calls}")
        self.tools: dict[str, Tool] = {tool.name: tool for tool in load_tools(tools, max_hung=max_hung_calls)}
        self.parser = parser if parser is not None else HermesToolCallParser()
        self.timeout_s = timeout_s
        self.max_calls_per_turn = max_calls_per_turn
        self.parallel_calls = parallel_calls
        self.error_reply = error_reply
        self.first_messages = [dict(m) for m in first_messages or []]
        if any(not isinstance(m.get("role"), str) or "content" not in m for m in self.first_messages):
            raise ConfigError("model.episodes.environment.init_args.first_messages must be chat messages, each with a role and a content")

    @property
    def tools_schema(self) -> list[dict]:
        return [tool.schema for tool in self.tools.values()]

    def reset(self, row: dict, prompt: list[dict]) -> list[dict]:
        return [*self.first_messages, *prompt]

    def fresh(self) -> "ToolEnvironment":
        # no per-episode state: the loaded tools and the parser are shared, not copied
        return copy.copy(self)

    def step(self, assistant_message: dict) -> StepResult:
        return asyncio.run(self.astep(assistant_message))

    def _error_reply(self, text: str, name: Optional[str] = None) -> dict:
        return {"role": "tool", **({"name": name} if name else {}), "content": self.error_reply.replace("{error}", text)}

    async def astep(self, assistant_message: dict) -> StepResult:
        text = assistant_message.get("content") or ""
        # calls written while reasoning are not calls: read only what follows the last </think>
        turn = self.parser.parse(text.rpartition("</think>")[2])
        counts = {"tool_calls": len(turn.calls) + len(turn.errors), "tool_errors": len(turn.errors),
                  "tool_timeouts": 0, "malformed_tool_calls": len(turn.errors)}

        async def reply(index: int, call) -> tuple[dict, Optional[str]]:
            """The call's reply, and the kind of its fault (None: it ran)."""
            if index >= self.max_calls_per_turn:
                return self._error_reply(f"at most {self.max_calls_per_turn} tool calls per turn; this call was not run",
                                    call.name), "refused"
            tool = self.tools.get(call.name)
            if tool is None:
                return self._error_reply(f"unknown tool {call.name!r}; the tools are {', '.join(self.tools) or 'none'}",
                                    call.name), "unknown"
            try:
                return {"role": "tool", "name": call.name, "content": await tool.acall(call.arguments, self.timeout_s)}, None
            except ToolError as err:
                return self._error_reply(str(err), call.name), err.kind

        if self.parallel_calls:
            outcomes = await asyncio.gather(*(reply(i, call) for i, call in enumerate(turn.calls)))
        else:
            outcomes = [await reply(i, call) for i, call in enumerate(turn.calls)]
        replies = [message for message, _ in outcomes]
        counts["tool_errors"] += sum(kind is not None for _, kind in outcomes)
        counts["tool_timeouts"] += sum(kind == "timeout" for _, kind in outcomes)
        replies.extend(self._error_reply(error) for error in turn.errors)
        return StepResult(messages=replies, done=not replies, info=counts)

__all__ = ["Environment", "ToolEnvironment"]
