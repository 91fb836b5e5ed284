"""The package's folders depend one way: a folder imports only from the folders before it in

    objective, rewards <- models <- data <- episodes <- rollout <- training <- run <- cli

(``errors.py``, ``_imports.py`` and the package's ``__init__.py`` are imported from anywhere).
Every import counts: at module level or inside a function, ``import gspo_lightning.x``,
``from gspo_lightning.x import ...`` and relative imports, read from the source with ``ast``
(nothing is imported). One import may run back up the order: a task with an environment (the
lookup task, ``data/tasks/lookup.py``) builds on ``episodes/``, which imports nothing from data/.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


PACKAGE = Path(__file__).resolve().parents[1] / "gspo_lightning"
ORDER = [("objective", "rewards"), ("models",), ("data",), ("episodes",), ("rollout",), ("training",), ("run",), ("cli",)]
RANK = {folder: rank for rank, folders in enumerate(ORDER) for folder in folders}
BASE = "base"  # errors.py, _imports.py, __init__.py at the top: below every folder
ALLOWED_BACK = 1
# still imported by training/module.py until the run's callbacks write the records and the export
# (run/callbacks.py: attach_run_callbacks) and the module drops configure_callbacks and those calls


@dataclass(frozen=True)
class Arrow:
    source: str  # folder
    target: str
    where: str  # file:line

    @property
    def back(self) -> bool:
        """Up the order, or between the two folders of one rank."""
        return RANK[self.target] >= RANK[self.source]


def folder_of(module: str) -> str:
    """``gspo_lightning.rollout.hf`` -> ``rollout``; ``gspo_lightning.cli`` -> ``cli``; the rest: base."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else BASE


def imported_modules(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import of the package in ``source`` (the module ``module``),
    wherever it stands; relative imports resolved, ``from gspo_lightning import x`` as ``...x``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from package import name`: name may be a module of it (a folder, for the top package)
            names = [f"{base}.{alias.name}" for alias in node.names] if base == "gspo_lightning" or not node.module \
                else [base]
        else:
            continue
        for name in names:
            if name.startswith("gspo_lightning."):
                yield node.lineno, name


def arrows() -> list[Arrow]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent)
        module = ".".join(relative.with_suffix("").parts)
        is_package = path.name == "__init__.py"
        if is_package:
            module = module.rpartition(".")[0]
        source = folder_of(module)
        for line, name in imported_modules(path.read_text(), module, is_package):
            target = folder_of(name)
            if BASE not in (source, target) and source != target:
                found.append(Arrow(source, target, f"{relative}:{line}"))
    return found


def cycles(found: list[Arrow]) -> list[list[str]]:
    """The folders that reach each other (strongly connected groups of two or more)."""
    graph: dict[str, set[str]] = {}
    for arrow in found:
        graph.setdefault(arrow.source, set()).add(arrow.target)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {folder: reach(folder) for folder in RANK}
    groups = {tuple(sorted(f for f in RANK if f == folder or (f in reached[folder] and folder in reached[f])))
              for folder in RANK}
    return [list(group) for group in sorted(groups) if len(group) > 1]


def listing(found: list[Arrow]) -> str:
    def place(arrow: Arrow) -> tuple[str, int]:
        path, line = arrow.where.rsplit(":", 1)
        return path, int(line)

    return "\n".join(f"  {a.where}: {a.source} -> {a.target}" for a in sorted(found, key=place))


def test_the_scan_sees_every_kind_of_import():
    source = ("import gspo_lightning.rollout.hf\nfrom gspo_lightning.models import tiny\nfrom . import engine\n"
              "from ..data.tasks import lookup\nfrom gspo_lightning import run, errors\nimport torch\n"
              "def f():\n    from gspo_lightning.training.module import GSPOModule\n")
    found = list(imported_modules(source, "gspo_lightning.rollout.worker", is_package=False))
    assert found == [(1, "gspo_lightning.rollout.hf"), (2, "gspo_lightning.models"), (3, "gspo_lightning.rollout.engine"),
                     (4, "gspo_lightning.data.tasks"), (5, "gspo_lightning.run"), (5, "gspo_lightning.errors"),
                     (8, "gspo_lightning.training.module")]
    assert [folder_of(name) for _, name in found] == ["rollout", "models", "rollout", "data", "run", BASE, "training"]
    assert list(imported_modules("from . import multi_turn", "gspo_lightning.episodes", is_package=True)) == [
        (1, "gspo_lightning.episodes.multi_turn")]
    assert len(arrows()) > 30


def test_the_folders_form_no_import_cycle():
    found = arrows()
    circles = cycles(found)
    assert not circles, "folders that import each other: " + "; ".join(" <-> ".join(c) for c in circles) + "\n" + \
        listing([a for a in found if any(a.source in c and a.target in c for c in circles)])


def test_at_most_one_import_runs_back_up_the_order():
    back = [a for a in arrows() if a.back]
    assert len(back) <= ALLOWED_BACK, f"{len(back)} imports run back up the folders' order " \
        f"({' <- '.join('/'.join(f) for f in ORDER)}), at most {ALLOWED_BACK}:\n{listing(back)}"


def test_the_tiny_models_read_the_shipped_corpus_without_importing_data():
    from gspo_lightning.data.datasets import BUILTIN_FILES
    from gspo_lightning.models.tiny import CORPUS_FILES

    assert CORPUS_FILES["gsm8k"] == (BUILTIN_FILES["gsm8k"], BUILTIN_FILES["gsm8k-heldout"])
    assert all(path.is_file() for path in CORPUS_FILES["gsm8k"])
