"""Progress in the run's one unit: rollout steps, the unit of ``trainer.max_steps``.

Lightning's bars count batches of the current epoch and title themselves "Epoch N" (Rich:
"Epoch 0/-2" when ``max_epochs`` is -1); a GSPO run streams prompts endlessly, so epochs
mean nothing and a resumed run would restart at 0. Three displays count steps instead:

- in a terminal, :class:`RichStepProgressBar` (when ``rich`` is installed) or
  :class:`StepProgressBar` (tqdm): ``step 37/100``; on a step slower than a couple of
  seconds the bar's title shows what the step is doing (``rollout/phases.py``:
  ``generating 64 responses, token 12/32``, ``log-probs``, ``update 2/4 optimizer steps``);
- without one (``nohup``, SLURM, a pipe), :class:`LineProgressBar`: a plain line every
  ``every_n_steps`` steps or every ``interval_s`` seconds, whichever comes first, and on a
  step slower than ``interval_s`` a line as each phase starts.

:func:`progress_bar_for` picks one for the ``gspo`` command; :func:`step_progress_bar`
replaces the bar a plain ``Trainer`` brings by the step bar of the same kind.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import Callable, Optional

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

from gspo_lightning.errors import ConfigError
from gspo_lightning.rollout.phases import PHASES

DESCRIPTION = "step"
SHOW_PHASE_AFTER_S = 2.0  # a bar's title names the phase once a step runs this long (no flicker on fast steps)


class Ticker:
    """Calls ``tick`` every ``period`` seconds on a daemon thread until :meth:`stop`."""

    def __init__(self, tick: Callable[[], None], period: float = 1.0) -> None:
        self._tick, self._period = tick, period
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gspo-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - a display must never stop a run
                pass

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None


def duration(seconds: float) -> str:
    """``0:01:05`` (hours:minutes:seconds)."""
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def phase_title(step_started: Optional[float], now: float) -> str:
    """The bar's title: ``step``, or ``step · update 2/4 optimizer steps`` on a slow step."""
    phase = PHASES.current
    if phase is None or step_started is None or now - step_started < SHOW_PHASE_AFTER_S:
        return DESCRIPTION
    return f"{DESCRIPTION} · {phase.describe()}"


def _total_steps(trainer, fallback) -> Optional[float]:
    return trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else fallback


class _TickingBar:
    """What the tqdm and Rich bars share: a thread redraws the bar every second while training
    (``_tick``: the elapsed time and, on a slow step, its phase), from the step's start time."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ticker = Ticker(self._tick)
        self._step_started: Optional[float] = None

    def _tick(self) -> None:
        raise NotImplementedError

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._ticker.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_started = time.monotonic()

    def on_train_end(self, trainer, pl_module) -> None:
        self._ticker.stop()
        super().on_train_end(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._ticker.stop()
        super().on_exception(trainer, pl_module, exception)


class StepProgressBar(_TickingBar, TQDMProgressBar):
    """``step 37/100`` where 37 is ``trainer.global_step`` (resumed runs start where they were)."""

    def _tick(self) -> None:
        bar = self.train_progress_bar
        if bar is not None and not bar.disable and self.trainer.training:
            bar.set_description(phase_title(self._step_started, time.monotonic()), refresh=False)
            bar.refresh()  # the elapsed time ticks too

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
        self._step_started = None
        bar.n = trainer.global_step
        bar.set_description(DESCRIPTION, refresh=False)
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()


class RichStepProgressBar(_TickingBar, RichProgressBar):
    """The Rich bar, counting ``trainer.global_step`` out of ``trainer.max_steps``."""

    def _get_train_description(self, current_epoch: int) -> str:
        return f"{DESCRIPTION:{len(self.validation_description)}}"  # padded: no flicker beside "Validation"

    @property
    def total_train_batches(self):
        return _total_steps(self.trainer, super().total_train_batches)

    def _add_task(self, total_batches, description: str, visible: bool = True):
        if description != self._get_train_description(0):
            return super()._add_task(total_batches, description, visible)
        # drawn from the start at the step it resumes from, out of max_steps: no "0/<batches>" first
        label = f"[{self.theme.description}]{description}" if self.theme.description else description
        return self.progress.add_task(label, total=total_batches, completed=self.trainer.global_step, visible=visible)

    def _tick(self) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None and self.trainer.training:
            title = phase_title(self._step_started, time.monotonic())
            self.progress.update(self.train_progress_bar_id, description=f"{title:{len(self.validation_description)}}")
            self.refresh()  # Lightning's refresh thread redraws only when asked: the elapsed time ticks too


    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, total=_total_steps(trainer, self.total_train_batches),
                                 completed=trainer.global_step)
            self.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._step_started = None
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=self._get_train_description(0))
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()


ESTIMATE_AFTER_STEPS = 3  # steps timed after the first before a line says how long is left


class LineProgressBar(ProgressBar):
    """Progress as plain lines, for logs (no terminal: ``nohup``, SLURM, a pipe).

    A line after every ``every_n_steps``-th step (``None``: a tenth of ``max_steps``), after a
    step that ends ``interval_s`` seconds or more after the last line, and after the last step::

        step 15/150  reward 0.412  step_s 0.21  elapsed 0:00:03  left ~0:00:28

    ("left: estimating" until three steps after the first are timed: the first warms up.)

    While a step or an evaluation runs, a line every ``interval_s`` seconds naming its phase,
    and, once steps take longer than ``interval_s``, one line as each phase starts::

        step 3/8  update 1/2 optimizer steps  0:00:12 in this phase, 0:01:05 into the step
    """

    def __init__(self, every_n_steps: Optional[int] = None, interval_s: float = 30.0) -> None:
        super().__init__()
        if every_n_steps is not None and every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be at least 1 (or null: a tenth of max_steps), got {every_n_steps}")
        if interval_s <= 0:
            raise ConfigError(f"interval_s must be positive, got {interval_s}")
        self.every_n_steps, self.interval_s = every_n_steps, interval_s
        self._enabled = True
        self._ticker = Ticker(self._tick)
        self._lock = threading.Lock()  # one line at a time, from the trainer's or the ticker's thread
        self._last_line = time.monotonic()
        self._started: Optional[float] = None  # this fit's first step
        self._first_step = 0
        self._running: Optional[tuple[str, float]] = None  # ("step 3/8" or "held-out evaluation", since)
        self._slow = False  # the last step took interval_s or more: a line per phase
        self._phase_printed = 0  # PHASES.changes at the last phase line

    # -- Lightning's ProgressBar interface --------------------------------------------------
    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def print(self, *args, **kwargs) -> None:
        with self._lock:
            print(*args, **kwargs, flush=True)
            self._last_line = time.monotonic()

    # -- what it prints ---------------------------------------------------------------------
    def _total(self, trainer) -> Optional[int]:
        return trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else None

    def _every(self, trainer) -> int:
        total = self._total(trainer)
        return self.every_n_steps or (max(1, round(total / 10)) if total else 10)

    def _step_name(self, trainer, step: int) -> str:
        total = self._total(trainer)
        return f"step {step}/{total}" if total else f"step {step}"

    def step_due(self, step: int, trainer, now: float) -> bool:
        """A line after this step?"""
        return (step % self._every(trainer) == 0 or now - self._last_line >= self.interval_s
                or step == self._first_step + 1 or step == self._total(trainer))

    def _tick(self) -> None:
        running, phase = self._running, PHASES.current
        if running is None or phase is None or not self._enabled:
            return
        now = time.monotonic()
        new_phase = self._slow and PHASES.changes != self._phase_printed
        if now - self._last_line >= self.interval_s or new_phase:
            self._phase_printed = PHASES.changes
            name, since = running
            self.print(f"{name}  {phase.describe()}  {duration(now - phase.started)} in this phase, "
                       f"{duration(now - since)} into the {'step' if name.startswith('step') else 'evaluation'}")

    def on_fit_start(self, trainer, pl_module) -> None:
        self._ticker.start()  # before the evaluation of the untrained model

    def on_train_start(self, trainer, pl_module) -> None:
        self._started = time.monotonic()
        self._first_step = trainer.global_step
        self._first_step_end = self._started

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._running = (self._step_name(trainer, trainer.global_step + 1), time.monotonic())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.monotonic()
        started = self._running[1] if self._running else now
        self._running = None
        self._slow = now - started >= self.interval_s
        step = trainer.global_step
        if not self._enabled or not self.step_due(step, trainer, now):
            return
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        parts = [self._step_name(trainer, step)] + [f"{k} {_number(v)}" for k, v in metrics.items()]
        elapsed = now - (self._started or now)
        parts.append(f"elapsed {duration(elapsed)}")
        total, done = self._total(trainer), step - self._first_step
        if done == 1:
            self._first_step_end = now
        if total and total > step:
            # the first step warms caches and times the CPU-thread trial: the pace is the later steps'
            timed = done - 1
            if timed >= ESTIMATE_AFTER_STEPS:
                parts.append(f"left ~{duration((now - self._first_step_end) / timed * (total - step))}")
            else:
                parts.append("left: estimating")
        self.print("  ".join(parts))

    def on_validation_start(self, trainer, pl_module) -> None:
        label = "evaluation of the untrained model" if trainer.global_step == 0 else f"held-out evaluation at step {trainer.global_step}"
        self._running = (label, time.monotonic())
        batches = sum(trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches)
        PHASES.begin("evaluating", total=int(batches) if math.isfinite(batches) else None, unit="batches")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        PHASES.advance()

    def on_validation_end(self, trainer, pl_module) -> None:
        PHASES.end(None)
        self._running = None

    def on_fit_end(self, trainer, pl_module) -> None:
        self._ticker.stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._ticker.stop()


def _number(value) -> str:
    value = float(value)
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def progress_bar_for(stream=None) -> ProgressBar:
    """The ``gspo`` command's display: a step bar in a terminal (Rich when installed), else lines."""
    stream = sys.stdout if stream is None else stream
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return LineProgressBar()
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    return RichStepProgressBar() if _RICH_AVAILABLE else StepProgressBar()


def step_progress_bar(current: Optional[ProgressBar]) -> Optional[ProgressBar]:
    """The step bar replacing the trainer's ``current`` bar (``None``: progress bar disabled)."""
    if current is None or isinstance(current, (StepProgressBar, RichStepProgressBar, LineProgressBar)):
        return None
    if isinstance(current, RichProgressBar):
        return RichStepProgressBar(refresh_rate=current._refresh_rate, leave=current._leave, theme=current.theme, console_kwargs=current._console_kwargs)
    if isinstance(current, TQDMProgressBar):
        return StepProgressBar(refresh_rate=current.refresh_rate, leave=current._leave)
    return None  # a user's own bar: theirs to title


__all__ = ["LineProgressBar", "RichStepProgressBar", "StepProgressBar", "progress_bar_for", "step_progress_bar"]
