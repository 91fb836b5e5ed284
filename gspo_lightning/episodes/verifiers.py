"""verifiers environments, unchanged (``model.episodes.verifiers``).

A verifiers (v1) environment drives its rollouts itself: its harness program (``null``: a plain
chat loop with the taskset's MCP tools) calls an OpenAI-compatible endpoint, and its task scores
the trace with its ``@vf.reward`` methods. Here that endpoint is the run's agent endpoint, which
samples with the policy and records every token: each episode is an agent episode whose agent is
:func:`verifiers_agent`. It runs the row's task with verifiers' own ``Env.run_episode`` against
the endpoint, with the episode's key, and returns verifiers' rewards by name (each ``score *
weight``, so they sum to verifiers' ``trace.reward``; logged as ``reward/<name>``).

The rows come from the same taskset (``data.path: verifiers``, ``gspo_lightning/data/verifiers.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
from typing import Optional

from gspo_lightning._imports import import_verifiers
from gspo_lightning.errors import ConfigError


@dataclasses.dataclass
class VerifiersSettings:
    """``model.episodes.verifiers``: a verifiers environment run unchanged.

    Args:
        id: the environment's taskset id (``owner/name@version`` or a module name: verifiers imports
            ``verifiers.v1.tasksets.<name>`` or the module ``<name>``, installed or on ``PYTHONPATH``).
        args: its ``TasksetConfig`` fields for the training rows (e.g. ``{split: train}``).
        eval_args: those of the held-out rows (``data.val_path: verifiers``); ``null``: the held-out
            rows are the last ``data.val_size`` training rows, as for any data file.
        harness: the verifiers harness that runs each episode (``null``: a chat loop; ``bash``,
            verifiers' default, adds a coding agent's tools and system prompt).
        runtime: where the harness program runs (``subprocess`` on this machine; verifiers' default
            is a remote sandbox).
    """

    id: str
    args: dict = dataclasses.field(default_factory=dict)
    eval_args: Optional[dict] = None
    harness: str = "null"
    runtime: str = "subprocess"

    def __post_init__(self):
        if not self.id:
            raise ConfigError("model.episodes.verifiers.id is empty: name the environment (its taskset id or module)")

    def split_args(self, split: str) -> Optional[dict]:
        """The taskset fields of ``split``: ``args`` for ``train``, ``eval_args`` for ``eval``."""
        return self.args if split == "train" else self.eval_args


@functools.lru_cache(maxsize=8)
def _environment(env_id: str, args_json: str, harness: str, runtime: str):
    vf = import_verifiers()
    spec = {"taskset": {"id": env_id, **json.loads(args_json)},
            "agent": {"harness": {"id": harness}, "runtime": {"type": runtime}}}
    try:
        environment = vf.load_environment(vf.resolve_env_config(spec))
    except Exception as err:  # noqa: BLE001 - pydantic / import errors of the user's environment
        raise ConfigError(f"model.episodes.verifiers: cannot load environment {env_id!r} with args {args_json} "
                          f"(harness {harness!r}, runtime {runtime!r}): {type(err).__name__}: {err}"[:1200]) from None
    return environment, list(environment.taskset)


def load_environment(settings: VerifiersSettings, split: str):
    """``(environment, tasks)`` of ``split``'s taskset, in verifiers' order (the rows'), loaded once per process."""
    args = json.dumps(settings.split_args(split) or {}, sort_keys=True)
    return _environment(settings.id, args, settings.harness, settings.runtime)


VERIFIERS_AGENT = "gspo_lightning.episodes.verifiers.verifiers_agent"


class VerifiersEpisodeError(RuntimeError):
    """verifiers ended an episode without a score (its harness or task failed)."""


async def verifiers_agent(row: dict, base_url: str, api_key: str, model: str, verifiers: dict) -> dict[str, float]:
    """One episode of the row's verifiers task against the run's endpoint; verifiers' rewards by name."""
    vf = import_verifiers()
    split = row.get("verifiers_split")
    if split not in ("train", "eval") or not isinstance(row.get("verifiers_index"), int):
        raise ConfigError("a verifiers episode needs its row from the environment's taskset (data.path: verifiers; "
                          f"this row has verifiers_split={split!r}, verifiers_index={row.get('verifiers_index')!r})")
    environment, tasks = load_environment(VerifiersSettings(**verifiers), split)
    task = tasks[row["verifiers_index"]]
    # verifiers reads an endpoint's key from an environment variable when the episode's client is
    # made: one variable per episode (its harness program does not see it: verifiers strips
    # variables named *API_KEY* from the programs it starts)
    variable = f"GSPO_EPISODE_API_KEY_{secrets.token_hex(8)}"
    os.environ[variable] = api_key
    try:
        context = vf.ModelContext(model=model, client=vf.EvalClientConfig(base_url=base_url, api_key_var=variable),
                                  sampling=vf.SamplingConfig())
        # no env.serving(): each episode brings up and tears down its own interception server,
        # and with it the client that holds this episode's key
        episode = await environment.run_episode(task, context)
    finally:
        os.environ.pop(variable, None)
    trace = episode.traces[0] if episode.traces else None
    if not episode.ok or trace is None or not trace.ok:
        errors = [*(trace.errors if trace is not None else []), *episode.errors]
        detail = "; ".join(getattr(e, "message", str(e)) for e in errors)[:600] or "no error recorded"
        raise VerifiersEpisodeError(f"verifiers episode of task {task.data.id!r} failed: {detail}")
    rewards = {name: reward.score * reward.weight for name, reward in trace.rewards.items()
               if reward is not None and reward.score is not None}
    if not rewards:
        raise VerifiersEpisodeError(f"verifiers scored no reward for task {task.data.id!r} (its Task has no @vf.reward)")
    return rewards


__all__ = ["VERIFIERS_AGENT", "VerifiersEpisodeError", "VerifiersSettings", "verifiers_agent"]
