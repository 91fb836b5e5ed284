"""How the package's names are found: each folder's public names, imported on first use, and
the objects whose import paths a config writes (reward functions, tools, engines).

Lazy, so that ``gspo --help`` and ``gspo serve`` import nothing they do not use, and so that
the ``gspo`` command sets OpenMP's environment before anything imports torch
(``run/cpu_env.py``). A name is imported from its module the first time it is read
(PEP 562), and then kept on the folder like any attribute.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable

from gspo_lightning.errors import ConfigError


def import_object(path: str, what: str, example: str = "package.module.name") -> Any:
    """The object at ``package.module.name`` (or ``package.module:name``): an import path written
    in a config (a reward function, a tool, a served engine's class). ``what`` names it in the
    errors; a module path of 0.1 (``gspo_lightning.tasks...``) is answered with today's."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{what} {path!r} is not an import path like {example!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        moved = moved_target(module_name)
        if moved is not None:
            raise ConfigError(f"cannot import module {module_name!r} of {what} {path!r}: {module_name} moved to "
                             f"{moved}: write that in the config") from err
        raise ConfigError(f"cannot import module {module_name!r} of {what} {path!r}: {err} (modules are looked up in "
                         f"the installed packages and the working directory {os.getcwd()!r})") from err
    found = getattr(module, attr, None)
    if found is None:
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r} ({what} {path!r})")
    return found


def import_verifiers():
    """``verifiers.v1`` (model.episodes.verifiers), or an error that says how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise ConfigError("model.episodes.verifiers needs the verifiers package (v1 API): pip install "
                          f"'gspo-lightning[verifiers]' (verifiers pins openai<3: an environment of its own) ({err})") from None
    return vf


def import_callable(path: str, what: str) -> Callable:
    """The callable at ``package.module.name`` (or ``package.module:name``): a config's reward
    function or tool. ``what`` names it in the errors ("reward function", "tool")."""
    found = import_object(path, what, example="package.module.function")
    if not callable(found):
        raise ConfigError(f"{what} {path!r} is a {type(found).__name__}, not a function")
    return found


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for a folder's ``__init__``: ``exports`` maps each public
    name to the module (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # found once, then a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__


# Module paths before the package was laid out by concern (0.1 as first released) -> today's.
# They no longer import: a config that names one (``gspo_lightning.tasks.successor.successor_reward``)
# is told the new path (``import_object``); a checkpoint's logger class is matched by it
# (``run/command.py``, ``current_class_path``).
MOVED = {
    "loss": "objective.loss", "advantages": "objective.advantages", "offpolicy": "objective.offpolicy",
    "clip_budget": "objective.clip_budget", "options": "objective.options", "evaluation": "objective.passk",
    "module": "training.module", "update": "training.update", "strategy_ops": "training.strategy_ops",
    "loss_scaling": "training.loss_scaling", "distributed": "training.distributed", "sharding": "training.sharding",
    "row_filters": "training.row_filters", "logprobs": "training.logprobs", "metrics": "training.metrics",
    "gguf_models": "models.gguf", "hf_cache": "models.hf_cache", "moe": "models.moe",
    "sampling": "rollout.sampling", "tasks": "data.tasks", "datasets": "data.datasets",
    "loggers": "run.loggers", "progress": "run.progress", "plotting": "run.plotting", "summary": "run.summary",
    "preemption": "run.preemption", "cpu_env": "run.cpu_env", "export": "run.export",
}


def moved_target(fullname: str, package: str = "gspo_lightning") -> str | None:
    """Today's module path for an old one (``gspo_lightning.tasks.echo`` -> ``...data.tasks.echo``), else None."""
    prefix = package + "."
    if not fullname.startswith(prefix):
        return None
    head, _, rest = fullname[len(prefix):].partition(".")
    new = MOVED.get(head)
    if new is None:
        return None
    return f"{prefix}{new}" + (f".{rest}" if rest else "")
