"""SkyRL-gym environments (``pip install -e '.[skyrl]'``), run unchanged.

A SkyRL-gym environment is made per episode as SkyRL's generator makes it,
``skyrl_gym.make(id, env_config=..., extras=<the dataset row>)``; ``init(prompt)`` gives the first
conversation, and each assistant turn's text goes to ``step(action)``, whose ``observations``
(chat messages) are the reply, ``reward`` the turn's reward and ``done`` the end; ``close()`` when
the episode ends. Its rewards are the episode's reward (summed over turns, as SkyRL's GRPO sums
its per-turn rewards; logged as ``reward/environment``), so the run needs no reward functions.

.. code-block:: yaml

    model:
      episodes:
        environment:
          class_path: gspo_lightning.episodes.SkyRLEnvironment
          init_args:
            env: gsm8k_multi_turn             # a registered id (skyrl_gym.envs.registry)
            env_config: {}                    # SkyRL's environment.skyrl_gym.<id> settings
            ground_truth_column: answer       # rows without SkyRL's reward_spec column

Rows in SkyRL's own format carry ``reward_spec`` (``{"ground_truth": ...}``) and ``extra_info``
columns; for a dataset with a plain answer column, ``ground_truth_column`` builds the
``reward_spec`` from it.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, Optional

from gspo_lightning.episodes.environments import Environment
from gspo_lightning.episodes.messages import StepResult
from gspo_lightning.errors import ConfigError


def _skyrl_gym():
    try:
        import skyrl_gym
        from omegaconf import OmegaConf
    except ImportError as err:
        raise ConfigError("SkyRLEnvironment needs the skyrl-gym package: pip install -e '.[skyrl]'") from err
    return skyrl_gym, OmegaConf


class SkyRLEnvironment(Environment):
    """A SkyRL-gym environment, one per episode.

    Args:
        env: its registered id (``gsm8k``, ``gsm8k_multi_turn``, ``text2sql``, ``search``, ... or one
            your code registered with ``skyrl_gym.register`` on import of ``register_module``).
        env_config: its settings, as SkyRL's ``environment.skyrl_gym.<id>`` config block.
        ground_truth_column: the column that becomes ``extras["reward_spec"]["ground_truth"]``
            when a row has no ``reward_spec`` of its own.
        register_module: a module imported first (where your own environments are registered).
    """

    scores_episodes = True

    def __init__(self, env: str, env_config: Optional[dict] = None, ground_truth_column: Optional[str] = None,
                 register_module: Optional[str] = None):
        skyrl_gym, _ = _skyrl_gym()
        if register_module is not None:
            import importlib

            importlib.import_module(register_module)
        if env not in skyrl_gym.envs.registration.registry:
            known = ", ".join(sorted(skyrl_gym.envs.registration.registry))
            raise ConfigError(f"model.episodes.environment.init_args.env: no SkyRL-gym environment {env!r} is "
                              f"registered (registered: {known}); register yours in register_module")
        self.env_id = env
        self.env_config = dict(env_config or {})
        self.ground_truth_column = ground_truth_column
        self.env: Any = None  # this episode's (reset)

    def fresh(self) -> "SkyRLEnvironment":
        return copy.copy(self)

    def reset(self, row: dict, prompt: list[dict]) -> list[dict]:
        skyrl_gym, OmegaConf = _skyrl_gym()
        extras = dict(row)
        if "reward_spec" not in extras and self.ground_truth_column is not None:
            if self.ground_truth_column not in row:
                raise ConfigError(f"SkyRLEnvironment: ground_truth_column {self.ground_truth_column!r} is not a column "
                                  f"of the row (columns: {sorted(row)})")
            extras["reward_spec"] = {"ground_truth": row[self.ground_truth_column]}
        extras.setdefault("extra_info", {})
        self.env = skyrl_gym.make(self.env_id, env_config=OmegaConf.create(self.env_config), extras=extras)
        messages, _ = self.env.init([dict(m) for m in prompt])
        return list(messages)

    def step(self, assistant_message: dict) -> StepResult:
        output = self.env.step(assistant_message.get("content") or "")
        info = {key: value for key, value in (output.get("metadata") or {}).items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)}
        return StepResult(messages=[dict(m) for m in output["observations"]], reward=float(output["reward"] or 0.0),
                          done=bool(output["done"]), info=info)

    async def afinish(self) -> dict[str, float]:
        await asyncio.to_thread(self.env.close)  # the episode has ended; its rewards came turn by turn
        return {}


__all__ = ["SkyRLEnvironment"]
