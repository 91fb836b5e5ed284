"""A verifiers taskset's tasks as prompt rows (``data.path: verifiers``, with ``model.episodes.verifiers``).

verifiers (Prime Intellect, v1 API) keeps its data in a ``Taskset``: one ``Task`` per row, built
from the taskset's config (``args``: its ``TasksetConfig`` fields, e.g. ``split``). Each row here
is a task's prompt as chat messages, the task's own fields (its answer, ...) and where to find the
task again (``verifiers_split``, ``verifiers_index``): the episode's agent
(:mod:`gspo_lightning.episodes.verifiers`) loads the same taskset and runs that task.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from gspo_lightning._imports import import_verifiers
from gspo_lightning.errors import ConfigError


@dataclasses.dataclass
class VerifiersTasks:
    """The tasks of a verifiers environment (the ``gspo`` command sets them from ``model.episodes.verifiers``).

    Args:
        id: the environment's taskset id or module.
        args: its ``TasksetConfig`` fields for the training rows.
        eval_args: those of the held-out rows (``data.val_path: verifiers``).
    """

    id: str
    args: dict = dataclasses.field(default_factory=dict)
    eval_args: Optional[dict] = None

    def split_args(self, split: str) -> Optional[dict]:
        """The taskset fields of ``split``: ``args`` for ``train``, ``eval_args`` for ``eval``."""
        return self.args if split == "train" else self.eval_args


def load_taskset(env_id: str, args: Optional[dict]) -> list:
    """The tasks of taskset ``env_id`` configured with ``args``, in verifiers' order."""
    vf = import_verifiers()
    try:
        config = vf.resolve_env_config({"taskset": {"id": env_id, **(args or {})}})
        return list(vf.load_taskset(config.taskset))
    except Exception as err:  # noqa: BLE001 - pydantic / import errors of the user's environment
        raise ConfigError(f"model.episodes.verifiers: cannot load the taskset of {env_id!r} with args {args or {}}: "
                          f"{type(err).__name__}: {err}; its module must be importable (installed, or on "
                          "PYTHONPATH) and export its Taskset"[:1200]) from None


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


def verifiers_rows(tasks: VerifiersTasks, split: str) -> list[dict]:
    """One row per task for ``split`` (train: ``args``, eval: ``eval_args``): ``prompt`` (chat
    messages), the task's own fields, ``verifiers_split`` and ``verifiers_index`` (the task's
    position: the agent loads the same taskset)."""
    vf = import_verifiers()
    base_fields = set(vf.TaskData.model_fields)
    rows = []
    for index, task in enumerate(load_taskset(tasks.id, tasks.split_args(split))):
        data = task.data
        fields = {k: v for k, v in data.model_dump(mode="json").items() if k not in base_fields}
        rows.append({**fields, "prompt": _messages(data), "verifiers_split": split, "verifiers_index": index})
    if not rows:
        raise ConfigError(f"verifiers environment {tasks.id!r} with args {tasks.split_args(split) or {}} has no tasks")
    return rows


__all__ = ["VerifiersTasks", "load_taskset", "verifiers_rows"]
