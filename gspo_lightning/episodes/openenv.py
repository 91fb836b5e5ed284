"""OpenEnv environment servers (``pip install -e '.[openenv]'``), run unchanged.

An OpenEnv environment is a server (``reset()``, ``step(action)``, ``state()`` over a WebSocket,
typed actions and observations); each episode opens its own session on it with the environment's
client, as TRL's OpenEnv examples do: ``reset`` starts it, each assistant turn becomes one action,
the observation comes back as a message, its ``reward`` is the turn's reward and ``done`` ends the
episode; the session closes when the episode ends. The sessions live on the run's event loop
(episodes/loop.py), all of a rollout's at once: the server must allow that many concurrent
sessions (``create_app(..., max_concurrent_envs=N)``, N at least the episodes of a rollout).

.. code-block:: yaml

    model:
      episodes:
        environment:
          class_path: gspo_lightning.episodes.OpenEnvEnvironment
          init_args:
            base_url: http://127.0.0.1:8000   # the environment's server, started as its docs say
            action_field: message             # the turn's text fills this field of the action
            observation_field: echoed_message # the observation's field the model reads

An OpenEnv server authenticates nothing: run it on 127.0.0.1 (or a private network) only.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Optional

from gspo_lightning._imports import import_object
from gspo_lightning.episodes.environments import Environment
from gspo_lightning.episodes.messages import StepResult
from gspo_lightning.errors import ConfigError

# what an observation carries besides what the model reads
NOT_SHOWN = ("done", "reward", "metadata")


class OpenEnvEnvironment(Environment):
    """An OpenEnv environment server, one session per episode.

    Args:
        base_url: the server (``http://`` or ``ws://``).
        client: the environment's client class (an ``EnvClient`` subclass, its import path), for
            typed actions; default OpenEnv's ``GenericEnvClient`` (plain dictionaries).
        action_field: the action's field the assistant turn's text goes into; ``null``: the turn
            is the action itself, a JSON object (a turn that is not one gets an error reply).
        action_class: the typed action (import path) a ``client`` expects; with the generic client
            the action stays a dictionary.
        observation_field: the observation's field shown to the model; ``null``: every field as
            JSON (``done``, ``reward`` and ``metadata`` left out).
        reply_role: the role of the observation's message.
        reset_columns: columns of the row passed to the server's ``reset`` as keyword arguments
            (a seed, a task id).
        first_observation: what ``reset``'s observation does: ``append`` it to the last prompt
            message (as TRL does with a string from ``reset``), add it as a ``message``, or ``drop`` it.
        message_timeout_s: how long one reply from the server may take.
    """

    scores_episodes = True

    def __init__(self, base_url: str, client: Optional[str] = None, action_field: Optional[str] = None,
                 action_class: Optional[str] = None, observation_field: Optional[str] = None, reply_role: str = "user",
                 reset_columns: Optional[list[str]] = None, first_observation: str = "append",
                 message_timeout_s: float = 60.0):
        try:
            from openenv.core import GenericEnvClient
        except ImportError as err:
            raise ConfigError("OpenEnvEnvironment needs the openenv-core package: pip install -e '.[openenv]'") from err
        if first_observation not in ("append", "message", "drop"):
            raise ConfigError(f"OpenEnvEnvironment first_observation must be append, message or drop, got "
                              f"{first_observation!r}")
        self.base_url = base_url
        self.client_class = import_object(client, "OpenEnv client", example="my_env.client.MyEnv") if client else GenericEnvClient
        self.action_class = import_object(action_class, "OpenEnv action", example="my_env.models.MyAction") if action_class else None
        self.action_field = action_field
        self.observation_field = observation_field
        self.reply_role = reply_role
        self.reset_columns = list(reset_columns or [])
        self.first_observation = first_observation
        self.message_timeout_s = message_timeout_s
        self.client: Any = None  # this episode's session (areset)

    def fresh(self) -> "OpenEnvEnvironment":
        return copy.copy(self)

    def _text(self, observation: Any) -> str:
        fields = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation or {})
        if self.observation_field is not None:
            if self.observation_field not in fields:
                raise ConfigError(f"OpenEnvEnvironment observation_field {self.observation_field!r} is not in the "
                                  f"server's observation (fields: {sorted(fields)})")
            value = fields[self.observation_field]
            return value if isinstance(value, str) else json.dumps(value)
        return json.dumps({k: v for k, v in fields.items() if k not in NOT_SHOWN})

    async def areset(self, row: dict, prompt: list[dict]) -> list[dict]:
        missing = [c for c in self.reset_columns if c not in row]
        if missing:
            raise ConfigError(f"OpenEnvEnvironment reset_columns {missing} are not columns of the row ({sorted(row)})")
        self.client = self.client_class(base_url=self.base_url, message_timeout_s=self.message_timeout_s)
        try:
            await self.client.connect()
            result = await self.client.reset(**{c: row[c] for c in self.reset_columns})
        except Exception as err:
            await self.client.close()
            raise RuntimeError(f"the OpenEnv server at {self.base_url} did not start an episode ({err}); a server "
                               "allows create_app(max_concurrent_envs=N) sessions at once, and every episode of a "
                               "rollout holds one: N must be at least the rollout's episodes") from err
        messages = [dict(m) for m in prompt]
        if self.first_observation == "drop":
            return messages
        text = self._text(result.observation)
        if self.first_observation == "append":
            messages[-1]["content"] = (messages[-1].get("content") or "") + text
            return messages
        return [*messages, {"role": self.reply_role, "content": text}]

    async def astep(self, assistant_message: dict) -> StepResult:
        text = assistant_message.get("content") or ""
        if self.action_field is not None:
            fields = {self.action_field: text}
        else:
            try:
                fields = json.loads(text)
            except json.JSONDecodeError as err:
                fields = err
            if not isinstance(fields, dict):
                reply = "Error: the action must be a JSON object of the environment's action fields"
                return StepResult(messages=[{"role": self.reply_role, "content": reply}], info={"tool_errors": 1})
        action = self.action_class(**fields) if self.action_class is not None else fields
        result = await self.client.step(action)
        return StepResult(messages=[{"role": self.reply_role, "content": self._text(result.observation)}],
                          reward=float(result.reward or 0.0), done=bool(result.done))

    async def afinish(self) -> dict[str, float]:
        await self.client.close()  # the session ends with the episode
        return {}


__all__ = ["OpenEnvEnvironment"]
