"""Offline tasks for the quickstart, tests and benchmarks, and (from ``models/tiny.py``) the locally
built tiny models they train."""

from gspo_lightning.data.tasks import addition, alternate, colours, echo, lookup, pattern, successor
from gspo_lightning.models.tiny import BUILTIN_PREFIX, TINY_MODELS, build_tiny, is_builtin, save_tiny

# builtin:<name> data sources: name -> function(num_rows, seed) -> rows
BUILTIN_DATASETS = {"echo": echo.make_rows, "successor": successor.make_rows, "alternate": alternate.make_rows,
                    "pattern": pattern.make_rows, "pattern-heldout": pattern.make_heldout_rows,
                    "addition": addition.make_rows, "addition-heldout": addition.make_heldout_rows,
                    "addition-2digit": addition.make_2digit_rows, "addition-2digit-heldout": addition.make_2digit_heldout_rows,
                    "lookup": lookup.make_rows, "colours": colours.make_rows,
                    "colours-episodes": colours.make_episode_rows}

__all__ = ["BUILTIN_DATASETS", "BUILTIN_PREFIX", "TINY_MODELS", "build_tiny", "is_builtin", "save_tiny"]
