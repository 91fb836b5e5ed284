"""A progress bar in the run's one unit: rollout steps, the unit of ``trainer.max_steps``.

Lightning's bar counts batches of the current epoch and titles itself "Epoch N"; a GSPO
run streams prompts endlessly, so epochs mean nothing and a resumed run would restart at 0.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import TQDMProgressBar


class StepProgressBar(TQDMProgressBar):
    """``step 37/100`` where 37 is ``trainer.global_step`` (resumed runs start where they were)."""

    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        if trainer.max_steps is not None and trainer.max_steps > 0:
            bar.total = trainer.max_steps
        bar.initial = trainer.global_step
        bar.n = trainer.global_step
        bar.set_description("step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        bar.n = trainer.global_step
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()


__all__ = ["StepProgressBar"]
