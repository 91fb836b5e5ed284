"""How the package's names are found: each folder's public names, imported on first use, and
the module paths of releases before the package was laid out by concern.

Lazy, so that ``gspo --help`` and ``gspo serve`` import nothing they do not use, and so that
the ``gspo`` command sets OpenMP's environment before anything imports torch
(``run/cpu_env.py``). A name is imported from its module the first time it is read
(PEP 562), and then kept on the folder like any attribute.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from typing import Callable


def import_callable(path: str, what: str) -> Callable:
    """The callable at ``package.module.name`` (or ``package.module:name``): a config's reward
    function or tool. ``what`` names it in the errors ("reward function", "tool")."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {path!r} is not an import path like 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} of {what} {path!r}: {err} (modules are looked up in "
                         f"the installed packages and the working directory {os.getcwd()!r})") from err
    found = getattr(module, attr, None)
    if found is None:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} ({what} {path!r})")
    if not callable(found):
        raise ValueError(f"{what} {path!r} is a {type(found).__name__}, not a function")
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
# Configs and checkpoints that name the old paths (``gspo_lightning.tasks.successor.successor_reward``,
# ``gspo_lightning.loggers.CSVLogger``, ``gspo_lightning.module.GSPOModule``) keep working: the old
# name is the same module object as the new one, so classes and isinstance checks agree.
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


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module it moved to (one object under both names)."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        new = moved_target(fullname)
        if new is None:
            return None
        found = importlib.util.find_spec(new)
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=found.submodule_search_locations is not None)

    def create_module(self, spec):
        new = moved_target(spec.name)
        old_head = ".".join(spec.name.split(".")[:2])  # gspo_lightning.tasks for gspo_lightning.tasks.echo
        if old_head not in self.warned:  # once per moved module, not again for each of its submodules
            self.warned.add(old_head)
            # FutureWarning, not DeprecationWarning: Python hides the latter outside __main__, and
            # the user whose config names the old path is the one who should read this
            warnings.warn(f"{old_head} moved to {moved_target(old_head)}; the old path still works, the new one is "
                          "preferred", FutureWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # the module ran under its own name already


def install_moved_modules() -> None:
    # first: the path finder would otherwise load ``gspo_lightning.tasks.echo`` a second time,
    # as a new module, from the folder of its alias ``gspo_lightning.tasks``
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
