"""The measuring callback of a ``gspo fit`` benchmark run (added to the run's config by
``bench_grid.py``; importable because the parent puts ``benchmarks/`` on ``PYTHONPATH``).

Per step it records the wall time between consecutive end-of-step hooks (so every
overhead of Lightning, logging and the module is in it), the CPU other processes used, the
module's own phase timers and the RSS high-water mark; at the end it writes
``result.json`` (``_common.ChildResult``) to ``out_dir``.
"""

from __future__ import annotations

import time

import lightning as L

from _common import ChildResult, StepClock, peak_rss_mib, reset_peak_rss, rss_mib, versions

START = time.perf_counter()  # this module is imported while the CLI builds the trainer
PHASES = {"generate": "time/generate", "score": "time/score", "logprobs": "time/logprobs",
          "train": "time/train", "weight_sync": "time/weight_sync", "step_internal": "time/step"}


class StepProbe(L.Callback):
    """Args:
        out_dir: where ``result.json`` goes.
        cell: the grid cell's name (recorded).
        fixed_length: no sampled token ends a response, as TRL's ``min_new_tokens`` (the
            engines have no ``ignore_eos`` option: their end-of-sequence ids are replaced).
        cprofile: write a cProfile of the steps after ``warmup`` here (empty: off).
        warmup: steps before the profile starts.
    """

    def __init__(self, out_dir: str, cell: str = "", fixed_length: bool = True, cprofile: str = "", warmup: int = 0):
        self.out_dir = out_dir
        self.fixed_length = fixed_length
        self.cprofile = cprofile
        self.warmup = warmup
        self.result = ChildResult("gspo", cell, versions=versions())
        self.profiler = None

    def on_train_start(self, trainer, pl_module):
        if self.fixed_length:
            engine = pl_module.worker.engine
            # the HF engine compares sampled ids with these (-1 never matches); vLLM refuses an
            # out-of-vocabulary stop id, and with none (it ignores the model's own EOS) never stops early
            engine.eos_token_ids = [] if type(engine).__name__ == "VLLMEngine" else [-1]
        r = self.result
        r.setup_s = time.perf_counter() - START
        r.baseline_rss_mib = rss_mib()
        r.load_peak_rss_mib = peak_rss_mib()
        r.peak_reset = reset_peak_rss()
        self._time_logging(pl_module)
        self.clock = StepClock()

    def _time_logging(self, pl_module) -> None:
        """Time the module's per-step metric logging (a diagnostic: ``log_step`` in ``extra``)."""
        log_step = getattr(pl_module, "_log_step", None)
        if log_step is None:
            return
        seconds = self.result.extra.setdefault("log_step_s", [])

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return log_step(*args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - start)

        pl_module._log_step = timed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        r = self.result
        r.update_peak_rss_mib.append(peak_rss_mib())  # the whole step: rollout and update
        reset_peak_rss()
        self.clock.lap(r)
        metrics = trainer.callback_metrics
        for phase, key in PHASES.items():
            seconds = float(metrics.get(key, 0.0))
            r.add_phase(phase, seconds if seconds == seconds else 0.0)  # NaN: the phase did not run this step
        r.response_length_mean.append(float(metrics.get("response/length_mean", float("nan"))))
        if self.cprofile and len(r.step_wall_s) == self.warmup:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()
        self.clock.mark()

    def on_train_end(self, trainer, pl_module):
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(self.cprofile)
        r = self.result
        r.rollout_peak_rss_mib = []
        r.finish_memory()
        r.extra["policy_version"] = pl_module.policy_version
        r.write(self.out_dir)
