"""Held-out results on the console, and the best of them kept.

:class:`HeldOutResults` prints each evaluation when it is measured and, at the end of ``fit``,
the held-out metric of the untrained model, the best and the last evaluation, with their
steps. The evaluation of the untrained model (``num_sanity_val_steps: -1``, Lightning's
sanity check over the whole validation set) is logged at step 0, as any other evaluation:
Lightning logs nothing of a sanity check.

:class:`BestCheckpoint` keeps the weights of the best evaluation as ``best.ckpt`` (weights
only: it is for the export, not for resuming); ``gspo fit --export=best`` adds it and
exports it at the end of ``fit`` instead of the last step's policy.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

# the step an evaluation is of: the module logs it too (training/ imports nothing from run/)
from gspo_lightning.training.metrics import eval_step

HELD_OUT_METRIC = "val/accuracy"  # greedy, all of the answer right (objective/passk.py)
ORDER = ("accuracy", "pass@", "reward_mean", "response_length")


def whole_sanity_check(trainer) -> bool:
    """Did the sanity check evaluate every validation batch (``num_sanity_val_steps: -1``)?"""
    return math.isinf(trainer.num_sanity_val_steps)


def counts_as_evaluation(trainer) -> bool:
    """An evaluation to record: not Lightning's sanity check, unless it is the whole validation
    set before the first step (the untrained model)."""
    return not trainer.sanity_checking or (trainer.global_step == 0 and whole_sanity_check(trainer))


def append_eval_record(trainer, pl_module, values: dict[str, float]) -> None:
    """One line of ``eval_results.jsonl`` in the run's log folder per evaluation (the untrained
    model's included), written by rank 0; every rank calls it (``trainer.log_dir`` is a collective)."""
    folder = Path(trainer.log_dir or trainer.default_root_dir)
    if trainer.is_global_zero and counts_as_evaluation(trainer):
        folder.mkdir(parents=True, exist_ok=True)
        # wall_time (Unix seconds, as TensorBoard's events): accuracy against the clock, not only steps
        record = {"step": eval_step(trainer, pl_module), "policy_version": pl_module.policy_version,
                  "wall_time": round(time.time(), 3), **values}
        with open(folder / "eval_results.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")


def format_results(values: dict[str, float]) -> str:
    """``accuracy 0.531  pass@1 0.531  reward_mean 0.715  response_length 6``, most telling first."""
    def rank(key: str) -> tuple[int, str]:
        short = key.split("/", 1)[-1]
        return next((i for i, prefix in enumerate(ORDER) if short.startswith(prefix)), len(ORDER)), short

    return "  ".join(f"{key.split('/', 1)[-1]} {values[key]:.3g}" for key in sorted(values, key=rank))


class HeldOutResults(L.Callback):
    """Prints every evaluation and, at the end of ``fit``, untrained -> best -> last."""

    def __init__(self, metric: str = HELD_OUT_METRIC) -> None:
        self.metric = metric
        self.evaluations: list[tuple[int, dict[str, float]]] = []  # (step, values), over resumes

    def _say(self, trainer, text: str) -> None:
        if not trainer.is_global_zero:
            return
        bar = trainer.progress_bar_callback
        (bar.print if bar is not None else print)(text)

    def _record(self, trainer, pl_module, stage: str) -> None:
        values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(f"{stage}/")}
        if not values or not counts_as_evaluation(trainer):
            return
        fitting = trainer.state.fn == "fit"
        step = eval_step(trainer, pl_module)
        if trainer.sanity_checking:  # Lightning logs nothing of a sanity check: step 0 of every curve
            for logger in trainer.loggers:
                logger.log_metrics(values, step=0)
                logger.save()
        if stage == "val" and fitting:
            self.evaluations = [e for e in self.evaluations if e[0] != step] + [(step, values)]
        label = {"val": "held-out", "test": "test"}[stage]
        self._say(trainer, f"{label} at step {step}{' (untrained)' if step == 0 else ''}: {format_results(values)}")

    def on_validation_end(self, trainer, pl_module) -> None:
        self._record(trainer, pl_module, "val")

    def on_test_end(self, trainer, pl_module) -> None:
        self._record(trainer, pl_module, "test")

    def summary(self) -> Optional[str]:
        """``held-out accuracy: untrained 0 (step 0) -> best 1 (step 75) -> last 1 (step 150)``."""
        scored = [(step, values[self.metric]) for step, values in self.evaluations if self.metric in values]
        if not scored:
            return None
        first, last = scored[0], scored[-1]
        best = max(scored, key=lambda e: e[1])  # the earliest of equal scores, as best.ckpt keeps
        name = self.metric.split("/", 1)[-1]
        parts = [f"{'untrained' if first[0] == 0 else 'first'} {first[1]:.3g} (step {first[0]})"]
        if len(scored) > 1:
            parts += [f"best {best[1]:.3g} (step {best[0]})", f"last {last[1]:.3g} (step {last[0]})"]
        return f"held-out {name}: " + " -> ".join(parts)

    def on_fit_end(self, trainer, pl_module) -> None:
        text = self.summary()
        if text is not None:
            self._say(trainer, text)

    # saved in checkpoints: a resumed run's summary covers the whole run
    def state_dict(self) -> dict:
        return {"evaluations": [[step, values] for step, values in self.evaluations]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.evaluations = [(int(step), dict(values)) for step, values in state_dict.get("evaluations", [])]


class EvalRecords(L.Callback):
    """``eval_results.jsonl``: one line per evaluation (:func:`append_eval_record`), from the
    metrics the module computed at the end of the evaluation (``pl_module.last_eval_metrics``,
    the values it logged under ``val/`` or ``test/``), so that training/ need not write run
    files. Lightning calls a callback's ``on_validation_epoch_end`` before the module's, so the
    record is written at ``on_validation_end`` / ``on_test_end``, once the module has them."""

    def __init__(self) -> None:
        self._written: Optional[dict] = None  # the module's last values already written

    def _write(self, trainer, pl_module) -> None:
        values = getattr(pl_module, "last_eval_metrics", None)
        # the module keeps its last values when an evaluation computed none: not written twice
        if not values or values is self._written:
            return
        self._written = values
        append_eval_record(trainer, pl_module, values)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._write(trainer, pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        self._write(trainer, pl_module)


class BestCheckpoint(ModelCheckpoint):
    """``best.ckpt``: the weights of the evaluation with the highest held-out metric (the
    earliest of equal scores), beside ``last.ckpt``; weights and hyperparameters only."""

    def __init__(self, dirpath: Optional[str] = None, monitor: str = HELD_OUT_METRIC) -> None:
        super().__init__(dirpath=dirpath, filename="best", monitor=monitor, mode="max", save_top_k=1,
                         save_weights_only=True, auto_insert_metric_name=False, enable_version_counter=False,
                         save_last=False, save_on_train_epoch_end=False)
        self.best_step: Optional[int] = None

    def _save_topk_checkpoint(self, trainer, monitor_candidates: dict) -> None:
        if self.monitor in monitor_candidates:  # no evaluation in this run (yet): nothing to keep, no warning
            super()._save_topk_checkpoint(trainer, monitor_candidates)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        self.best_step = trainer.global_step
        super()._save_checkpoint(trainer, filepath)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "best_step": self.best_step}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.best_step = state_dict.get("best_step")


def best_checkpoint(trainer) -> Optional[BestCheckpoint]:
    return next((c for c in trainer.callbacks if isinstance(c, BestCheckpoint)), None)


__all__ = ["BestCheckpoint", "EvalRecords", "HeldOutResults", "best_checkpoint", "counts_as_evaluation",
           "format_results"]
