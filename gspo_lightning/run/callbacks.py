"""The callbacks every GSPO run gets (``GSPOModule.configure_callbacks``), whatever built the
trainer: CPU threads chosen from the run's own first steps, training curves, held-out results on the console, the preemption checkpoint, and
the project's progress bar and run summary in place of Lightning's of the same kind."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback, ModelSummary


def run_callbacks(trainer) -> list[Callback]:
    from gspo_lightning.run.cpu_threads import CPUThreads
    from gspo_lightning.run.plotting import TrainingCurves
    from gspo_lightning.run.preemption import PreemptionCheckpoint
    from gspo_lightning.run.progress import step_progress_bar
    from gspo_lightning.run.results import HeldOutResults
    from gspo_lightning.run.summary import run_summary

    summaries = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    # replace Lightning's bar and table (epochs, FLOPs) by ours, of the same kind; a disabled one stays off
    extra = [step_progress_bar(trainer.progress_bar_callback), run_summary(summaries[0] if summaries else None)]
    return [CPUThreads(), TrainingCurves(), HeldOutResults(), PreemptionCheckpoint(), *(c for c in extra if c is not None)]
