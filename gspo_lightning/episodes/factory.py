"""Environment classes written for TRL's ``GRPOTrainer(environment_factory=...)``, run unchanged.

TRL's contract (its ``environment_factory`` documentation, TRL 1.x), which this follows:

- the class is built with no arguments, one instance per episode;
- ``reset(**row)`` is called with every column of the episode's dataset row (``prompt`` too) before
  the first turn; when it returns a string, that string is appended to the last prompt message;
- every public method (a function on the class whose name does not start with ``_``), except
  ``reset`` and ``get_reward``, is a tool: its schema is ``transformers.utils.get_json_schema``'s
  (type hints and a Google-style docstring), ``async def`` methods are awaited, a result becomes
  the tool message's text with ``str()``;
- ``get_reward()``, when the class defines it, scores the finished episode from the instance's
  state: it is added to the episode's reward with weight 1 and logged under the class's name;
- reward functions receive the episodes' instances as ``environments=``.

.. code-block:: yaml

    model:
      episodes:
        environment_factory: my_envs.IncrementEnv   # the class, as TRL is given it
        tool_call_parser:                             # how calls are read (default: Hermes)
          class_path: gspo_lightning.episodes.HermesToolCallParser

Calls are read by ``model.episodes.tool_call_parser``; a turn without a call ends the episode, as
in TRL. Where this differs from TRL: a failed call's reply is ``Error: <reason>`` (TRL's is
``{'error': '<reason>'}``), a malformed call gets such a reply instead of ending the episode,
calls are bounded in time (``timeout_s``), and instances are not reused between episodes (TRL
pools them): put what is costly to build in the class (a shared client), not in ``__init__``.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from typing import Any, Callable, Optional, Union

from gspo_lightning._imports import import_callable
from gspo_lightning.episodes.environments import ToolEnvironment
from gspo_lightning.episodes.parsers import ToolCallParser
from gspo_lightning.episodes.tools import Tool
from gspo_lightning.errors import ConfigError

NOT_TOOLS = ("reset", "get_reward")


def tool_method_names(cls: type) -> list[str]:
    """The methods TRL makes tools of: public functions on the class, ``reset`` and ``get_reward`` aside."""
    # on the class, as TRL lists them: listing an instance would evaluate its properties
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS]


class FactoryEnvironment(ToolEnvironment):
    """A TRL environment class (``environment_factory``) as an environment of this trainer.

    Args:
        factory: the class (or any no-argument callable returning an instance), or its import path.
        parser: reads the calls from a turn's text (``model.episodes.tool_call_parser``).
        timeout_s: the longest one call may run before its reply is a timeout error.
        max_calls_per_turn: calls past this many in one turn are not run; each gets an error reply.
        parallel_calls: run a turn's calls side by side.
        max_hung_calls: calls of one tool that may still be running past their timeout.
        error_reply: the reply to a failed call, ``{error}`` replaced by the reason.
    """

    def __init__(self, factory: Union[str, Callable[[], Any]], parser: Optional[ToolCallParser] = None,
                 timeout_s: float = 30.0, max_calls_per_turn: int = 4, parallel_calls: bool = False,
                 max_hung_calls: int = 8, error_reply: str = "Error: {error}"):
        super().__init__([], parser=parser, timeout_s=timeout_s, max_calls_per_turn=max_calls_per_turn,
                         parallel_calls=parallel_calls, max_hung_calls=max_hung_calls, error_reply=error_reply)
        self.factory = import_callable(factory, "environment_factory") if isinstance(factory, str) else factory
        self.name = getattr(self.factory, "__name__", type(self.factory).__name__)
        probe = self._build()  # built once here: its methods give the tools' schemas, checked now
        if not callable(getattr(probe, "reset", None)):
            raise ConfigError(f"model.episodes.environment_factory: {self.name} has no reset method; TRL's contract "
                              "needs reset(**row) -> str | None (it starts each episode)")
        self.tools = {}
        for name in tool_method_names(type(probe)):
            tool = Tool(getattr(probe, name), max_hung=max_hung_calls, as_text=str)
            self.tools[tool.name] = tool
        self.scores_episodes = callable(getattr(probe, "get_reward", None))
        self.instance: Any = None  # this episode's (fresh())

    def _build(self) -> Any:
        try:
            return self.factory()
        except Exception as err:
            raise ConfigError(f"model.episodes.environment_factory: {self.name}() raised {type(err).__name__}: {err}; "
                              "TRL builds it with no arguments, so must this trainer") from err

    def fresh(self) -> "FactoryEnvironment":
        environment = copy.copy(self)
        environment.instance = instance = self._build()
        # the same tools, calling this instance's methods
        environment.tools = {name: tool.bound_to(getattr(instance, tool.function.__name__))
                             for name, tool in self.tools.items()}
        return environment

    def reset(self, row: dict, prompt: list[dict]) -> list[dict]:
        observation = self.instance.reset(**row)
        if inspect.iscoroutine(observation):
            observation = asyncio.run(observation)
        messages = [dict(m) for m in prompt]
        if observation is None:
            return messages
        if not isinstance(observation, str):
            raise ConfigError(f"{self.name}.reset() returned a {type(observation).__name__}: TRL's contract is a "
                              "string (appended to the last prompt message) or None")
        messages[-1]["content"] = (messages[-1].get("content") or "") + observation
        return messages

    def rewards(self) -> dict[str, float]:
        if not self.scores_episodes:
            return {}
        reward = self.instance.get_reward()
        if inspect.iscoroutine(reward):
            reward = asyncio.run(reward)
        return {self.name: float(reward)}

    async def afinish(self) -> dict[str, float]:
        if not self.scores_episodes:  # no get_reward: nothing to run in a thread
            return {}
        return await super().afinish()

    def for_rewards(self) -> Any:
        return self.instance


__all__ = ["FactoryEnvironment", "tool_method_names"]
