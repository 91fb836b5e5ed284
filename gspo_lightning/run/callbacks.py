"""The callbacks every GSPO run gets: CPU threads chosen from the run's own first steps,
training curves, held-out results on the console and in ``eval_results.jsonl``, the preemption
checkpoint, the ``hf_model`` export at the end of ``fit``, and the project's progress bar and run
summary in place of Lightning's of the same kind. The run reaches training through these
callbacks, so training/ imports nothing from run/: the ``gspo`` command calls
:func:`attach_run_callbacks` on the trainer it builds, and a script building its own ``Trainer``
does the same (``gspo_lightning.run.attach_run_callbacks(trainer)``) before ``fit``."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Callback, Checkpoint, ModelSummary


def run_callbacks(trainer, stop_grace_s: float = 10.0) -> list[Callback]:
    """The run's callbacks for ``trainer``; ``stop_grace_s``: the seconds a SIGTERM / Ctrl-C stop may take."""
    from gspo_lightning.run.cpu_threads import CPUThreads
    from gspo_lightning.run.plotting import TrainingCurves
    from gspo_lightning.run.preemption import PreemptionCheckpoint
    from gspo_lightning.run.progress import step_progress_bar
    from gspo_lightning.run.results import EvalRecords, HeldOutResults
    from gspo_lightning.run.summary import run_summary

    summaries = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    # replace Lightning's bar and table (epochs, FLOPs) by ours, of the same kind; a disabled one stays off
    extra = [step_progress_bar(trainer.progress_bar_callback), run_summary(summaries[0] if summaries else None)]
    # the export last: after the curves and the held-out summary, as the module's own on_fit_end ran
    return [CPUThreads(), TrainingCurves(), HeldOutResults(), PreemptionCheckpoint(stop_grace_s), *(c for c in extra if c is not None),
            EvalRecords(), ExportOnFitEnd()]


def attach_run_callbacks(trainer, stop_grace_s: float = 10.0) -> list[Callback]:
    """Add the run's callbacks (:func:`run_callbacks`) to a built
    ``trainer``, as Lightning attaches a module's ``configure_callbacks``: each replaces the
    trainer's callbacks of a class it derives from (Lightning's bar and summary; ours from an
    earlier call), checkpoint callbacks stay last. Returns the callbacks added."""
    ours = run_callbacks(trainer, stop_grace_s)
    replaced = {type(c) for c in trainer.callbacks
                if type(c) is not Callback and any(isinstance(o, type(c)) for o in ours)}
    kept = [c for c in trainer.callbacks if type(c) not in replaced]
    trainer.callbacks = ([c for c in kept if not isinstance(c, Checkpoint)] + ours
                         + [c for c in kept if isinstance(c, Checkpoint)])
    return ours


class ExportOnFitEnd(Callback):
    """``export_on_fit_end``: the policy saved with ``save_pretrained`` into the run's log folder
    (``hf_model``) at the end of ``fit`` (:func:`~gspo_lightning.run.export.export_after_fit`:
    rank 0; merged LoRA with its adapter folder; ``--export=best``), from the module's public
    ``policy``, ``tokenizer``, ``lora``, ``model_source`` and ``sharded``.

    Not when this ``fit`` trained nothing because the checkpoint is already at ``max_steps``: the
    module's own ``on_fit_end`` (called after the callbacks') says so and stops the run."""

    def __init__(self) -> None:
        self._trained = False

    def on_fit_start(self, trainer, pl_module) -> None:
        self._trained = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._trained = True

    def on_fit_end(self, trainer, pl_module) -> None:
        from gspo_lightning.run.export import export_after_fit

        export = getattr(pl_module, "export_on_fit_end", None)
        if not (export if export is not None else getattr(pl_module, "hparams", {}).get("export_on_fit_end", False)):
            return
        step, max_steps = trainer.global_step, trainer.max_steps
        if not self._trained and max_steps is not None and 0 <= max_steps <= step:
            return  # nothing to train: the module raises next, with what to do
        # every rank computes the folder (trainer.log_dir is a collective); rank 0 writes
        folder = Path(trainer.log_dir or trainer.default_root_dir) / "hf_model"
        export_after_fit(pl_module.policy, pl_module.tokenizer, folder, sharded=pl_module.sharded, trainer=trainer,
                         lora=pl_module.lora, base_model=pl_module.model_source)


__all__ = ["ExportOnFitEnd", "attach_run_callbacks", "run_callbacks"]
