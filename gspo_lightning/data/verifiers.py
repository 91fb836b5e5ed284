"""A verifiers taskset's tasks as prompt rows (``data.path: verifiers``, with ``model.episodes.verifiers``).

verifiers (Prime Intellect, v1 API) keeps its data in a ``Taskset``: one ``Task`` per row, built
from the taskset's config (``args``: its ``TasksetConfig`` fields, e.g. ``split``). Each row here
is a task's prompt as chat messages, the task's own fields (its answer, ...) and where to find the
task again (``verifiers_split``, ``verifiers_index``): the episode's agent
(:mod:`gspo_lightning.episodes.verifiers`) loads the same taskset and runs that task.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Optional

from gspo_lightning.errors import ConfigError

INSTALL = "pip install 'gspo-lightning[verifiers]' (verifiers pins openai<3: an environment of its own)"


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


def import_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise ConfigError(f"model.episodes.verifiers needs the verifiers package (v1 API): {INSTALL} ({err})") from None
    return vf


def environment_config(env_id: str, args: Optional[dict], harness: str = "null", runtime: str = "subprocess"):
    """verifiers' config of environment ``env_id`` with taskset fields ``args``, one agent seat
    with ``harness`` in a ``runtime`` (verifiers' defaults are a coding agent's harness in a remote sandbox)."""
    vf = import_verifiers()
    spec = {"taskset": {"id": env_id, **(args or {})},
            "agent": {"harness": {"id": harness}, "runtime": {"type": runtime}}}
    try:
        return vf.resolve_env_config(spec)
    except Exception as err:  # noqa: BLE001 - pydantic / import errors of the user's environment
        raise ConfigError(f"model.episodes.verifiers: cannot configure environment {env_id!r} with args {args or {}} "
                          f"(harness {harness!r}, runtime {runtime!r}): {type(err).__name__}: {err}"[:1200]) from None


@functools.lru_cache(maxsize=8)
def _environment(env_id: str, args_json: str, harness: str, runtime: str):
    vf = import_verifiers()
    config = environment_config(env_id, json.loads(args_json), harness, runtime)
    try:
        environment = vf.load_environment(config)
    except Exception as err:  # noqa: BLE001
        raise ConfigError(f"model.episodes.verifiers: cannot load environment {env_id!r}: {type(err).__name__}: {err}; "
                          "its module must be importable (installed, or on PYTHONPATH) and export its Taskset"[:1200]) from None
    return environment, list(environment.taskset)


def load_environment(env_id: str, args: Optional[dict], harness: str = "null", runtime: str = "subprocess"):
    """``(environment, tasks)``: the environment and its taskset's tasks in order, loaded once per process."""
    return _environment(env_id, json.dumps(args or {}, sort_keys=True), harness, runtime)


def split_args(settings: VerifiersSettings, split: str) -> Optional[dict]:
    """The taskset fields of ``split``: ``args`` for ``train``, ``eval_args`` for ``eval``."""
    return settings.args if split == "train" else settings.eval_args


def _messages(data: Any) -> list[dict]:
    """A task's prompt as chat messages: its system prompt, then its prompt (text or messages)."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    prompt = data.prompt
    if isinstance(prompt, str):
        return messages + [{"role": "user", "content": prompt}]
    for message in prompt or []:
        wire = message.model_dump(mode="json", exclude_none=True) if hasattr(message, "model_dump") else dict(message)
        if not isinstance(wire.get("content"), str):
            raise ConfigError(f"verifiers task {data.id!r}: a prompt message without plain text content "
                              f"({str(wire)[:120]}); only text prompts are supported")
        messages.append({"role": wire["role"], "content": wire["content"]})
    return messages


def verifiers_rows(settings: VerifiersSettings, split: str) -> list[dict]:
    """One row per task of the environment of ``settings`` (``model.episodes.verifiers``: ``id``,
    ``args`` / ``eval_args``, ``harness``, ``runtime``) for ``split`` (train or eval): ``prompt``
    (chat messages), the task's own fields, ``verifiers_split`` and ``verifiers_index`` (the
    task's position: the agent loads the same taskset)."""
    vf = import_verifiers()
    _, tasks = load_environment(settings.id, split_args(settings, split), settings.harness, settings.runtime)
    base_fields = set(vf.TaskData.model_fields)
    rows = []
    for index, task in enumerate(tasks):
        data = task.data
        fields = {k: v for k, v in data.model_dump(mode="json").items() if k not in base_fields}
        rows.append({**fields, "prompt": _messages(data), "verifiers_split": split, "verifiers_index": index})
    if not rows:
        raise ConfigError(f"verifiers environment {settings.id!r} with args {split_args(settings, split) or {}} "
                          "has no tasks")
    return rows


__all__ = ["VerifiersSettings", "environment_config", "import_verifiers", "load_environment", "split_args", "verifiers_rows"]
