"""A progress bar in the run's one unit: rollout steps, the unit of ``trainer.max_steps``.

Lightning's bars count batches of the current epoch and title themselves "Epoch N" (Rich:
"Epoch 0/-2" when ``max_epochs`` is -1); a GSPO run streams prompts endlessly, so epochs
mean nothing and a resumed run would restart at 0. :func:`step_progress_bar` picks the
variant of the bar the trainer already has (Rich when ``rich`` is installed, else tqdm), so
the module's bar replaces it rather than adding a second one.
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

DESCRIPTION = "step"


def _total_steps(trainer, fallback) -> Optional[float]:
    return trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else fallback


class StepProgressBar(TQDMProgressBar):
    """``step 37/100`` where 37 is ``trainer.global_step`` (resumed runs start where they were)."""

    def on_train_epoch_start(self, trainer, *args) -> None:
        # Lightning's version titles the bar "Epoch N" and counts from 0; only the bar's setup is kept
        if self._leave or self.train_progress_bar is None:
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        total = _total_steps(trainer, self.total_train_batches)
        bar.reset(total=None if total == float("inf") else total)
        bar.initial = bar.n = trainer.global_step
        bar.set_description(DESCRIPTION, refresh=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        bar.n = trainer.global_step
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()


class RichStepProgressBar(RichProgressBar):
    """The Rich bar, counting ``trainer.global_step`` out of ``trainer.max_steps``."""

    def _get_train_description(self, current_epoch: int) -> str:
        return f"{DESCRIPTION:{len(self.validation_description)}}"  # padded: no flicker beside "Validation"

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, total=_total_steps(trainer, self.total_train_batches),
                                 completed=trainer.global_step)
            self.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()


def step_progress_bar(current: Optional[ProgressBar]) -> Optional[ProgressBar]:
    """The step bar replacing the trainer's ``current`` bar (``None``: progress bar disabled)."""
    if current is None or isinstance(current, (StepProgressBar, RichStepProgressBar)):
        return None
    if isinstance(current, RichProgressBar):
        return RichStepProgressBar(refresh_rate=current._refresh_rate, leave=current._leave, theme=current.theme, console_kwargs=current._console_kwargs)
    if isinstance(current, TQDMProgressBar):
        return StepProgressBar(refresh_rate=current.refresh_rate, leave=current._leave)
    return None  # a user's own bar: theirs to title


__all__ = ["RichStepProgressBar", "StepProgressBar", "step_progress_bar"]
