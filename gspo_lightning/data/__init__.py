"""Data: the DataModule (files, ``builtin:`` data, templates, the endless sharded sampler), the
built-in offline tasks (``tasks/``; their tiny models are built in ``models/tiny.py``), and data
shipped with the package (``datasets/``)."""

from gspo_lightning._imports import lazy_exports

EXPORTS = {name: "datamodule" for name in ["PromptDataModule", "DataError", "EndlessBatchSampler", "read_rows"]}
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
