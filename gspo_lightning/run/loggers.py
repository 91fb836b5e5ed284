"""Loggers that write under the run folder, and a CSV logger whose version folder survives a resume.

``save_dir`` may be left out: the ``gspo`` command fills in ``trainer.default_root_dir``
(``cli.run_folder_loggers``), so one key moves logs and checkpoints; built in Python
without one, they write under ``runs``.

Lightning's ``CSVLogger`` deletes ``metrics.csv`` when it opens a version folder that
already has one, so a run resumed into its own version would lose its history. This one
keeps the earlier rows up to the step the run resumes from (rows logged after the
checkpoint are replaced by the resumed run's) and appends. The ``gspo`` command points a
resumed ``fit`` at the checkpoint's version folders (``run/command.py``).
"""

from __future__ import annotations

import csv
from typing import Any, Optional, Union

from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class _ContinuingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        self._earlier: list[dict[str, Any]] = []
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                self._earlier = list(csv.DictReader(handle))

    def save(self) -> None:
        if self._earlier and self.metrics:
            first_new = min(int(m["step"]) for m in self.metrics)
            kept = [row for row in self._earlier if row.get("step") and int(float(row["step"])) < first_new]
            keys = sorted(set().union(*(row.keys() for row in kept), *(m.keys() for m in self.metrics)))
            self.metrics_keys = keys
            with self._fs.open(self.metrics_file_path, "w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=keys)
                writer.writeheader()
                writer.writerows(kept)
            self._earlier = []
        super().save()


DEFAULT_SAVE_DIR = "runs"


class CSVLogger(LightningCSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that continues ``metrics.csv`` of an existing
    version; ``save_dir`` ``None``: the run folder (``trainer.default_root_dir`` with ``gspo``)."""

    def __init__(self, save_dir: Optional[str] = None, name: Optional[str] = "lightning_logs",
                 version: Optional[Union[int, str]] = None, prefix: str = "", flush_logs_every_n_steps: int = 100):
        super().__init__(save_dir if save_dir is not None else DEFAULT_SAVE_DIR, name=name, version=version,
                         prefix=prefix, flush_logs_every_n_steps=flush_logs_every_n_steps)

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(log_dir=self.log_dir)
        return self._experiment


class TensorBoardLogger(LightningTensorBoardLogger):
    """``lightning.pytorch.loggers.TensorBoardLogger``; ``save_dir`` ``None``: the run folder."""

    def __init__(self, save_dir: Optional[str] = None, name: Optional[str] = "lightning_logs",
                 version: Optional[Union[int, str]] = None, log_graph: bool = False, default_hp_metric: bool = True,
                 prefix: str = "", sub_dir: Optional[str] = None, **kwargs: Any):
        super().__init__(save_dir if save_dir is not None else DEFAULT_SAVE_DIR, name=name, version=version,
                         log_graph=log_graph, default_hp_metric=default_hp_metric, prefix=prefix, sub_dir=sub_dir, **kwargs)


__all__ = ["CSVLogger", "TensorBoardLogger"]
