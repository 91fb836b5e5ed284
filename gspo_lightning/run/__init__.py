"""The run around training: the ``gspo fit|validate|test`` command, loggers that write into the
run folder, the progress bar, the start-of-run summary, curves, preemption checkpoints, CPU
thread settings, the Hugging Face export."""

from gspo_lightning._imports import lazy_exports

EXPORTS = {
    **dict.fromkeys(["CSVLogger", "TensorBoardLogger"], "loggers"),
    **dict.fromkeys(["StepProgressBar", "RichStepProgressBar", "LineProgressBar"], "progress"),
    **dict.fromkeys(["RunSummary", "RichRunSummary"], "summary"),
    **dict.fromkeys(["TrainingCurves", "plot_history"], "plotting"),
    **dict.fromkeys(["PreemptionCheckpoint", "Preempted", "Stopped"], "preemption"),
    "configure_cpu_env": "cpu_env",
    **dict.fromkeys(["run_callbacks", "attach_run_callbacks", "ExportOnFitEnd"], "callbacks"),
    "EvalRecords": "results",
    **dict.fromkeys(["save_policy", "export_checkpoint"], "export"),
}
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
