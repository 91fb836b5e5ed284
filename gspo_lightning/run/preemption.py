"""Never lose a run: a checkpoint when SIGTERM / SIGINT stops it, one at the end of fit, one
when a step's rollout fails, and one for inspection when training stops on non-finite updates.

``last.ckpt`` is always the newest state of the run: ``ModelCheckpoint`` writes it every
``every_n_train_steps``, this callback on a stop and at the end of fit (``ModelCheckpoint``
alone writes none there once it wrote one during the run), and a resumed run overwrites it
(the CLI turns off ``ModelCheckpoint``'s version counter, which would write ``last-v1.ckpt``).

SIGTERM (preemption, ``scancel``, ``docker stop``) and the first Ctrl-C both stop within
``stop_grace_s`` (10 s by default): a step still generating is abandoned, one in its update
finishes it, then ``last.ckpt`` is written; a second signal aborts at once.
Resume with ``gspo fit --config ... --ckpt_path <dir>/last.ckpt``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from gspo_lightning.errors import AgentError, ConfigError, NonFiniteError, RolloutServerError
from gspo_lightning.rewards.base import RewardError
from gspo_lightning.rollout import stop

log = logging.getLogger(__name__)


def checkpoint_dir(trainer: L.Trainer) -> Path:
    callback = trainer.checkpoint_callback
    if callback is not None and getattr(callback, "dirpath", None):
        return Path(callback.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


class Preempted(Exception):
    """Raised to end ``fit`` after the preemption checkpoint was written."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{reason}: checkpoint written to {path}; resume with --ckpt_path {path}")
        self.path = path


# failures of a step's rollout that have their own line: (error type, what happened, what to do first)
ROLLOUT_FAILURES = ((RewardError, "a reward function failed", "fix the function, then"),
                    (AgentError, "the agent failed", "fix the agent, then"),
                    (RolloutServerError, "no rollouts", "once a rollout server is up,"))


class Stopped(BaseException):
    """Raised in the trainer's thread by a first SIGTERM / Ctrl-C during a step's rollout: the
    step is abandoned and the state of the last finished step is written (``on_exception``).
    A ``BaseException``, as ``KeyboardInterrupt``: the code it interrupts (a reward function's
    or an environment's error handling) must not take it for their own failure."""

    def __init__(self, reason: str, evaluation: bool = False):
        super().__init__(f"{reason}: the {'evaluation' if evaluation else 'step'}'s generation was abandoned")
        self.reason = reason
        self.evaluation = evaluation  # an evaluation between steps, not a step's rollout


class PreemptionCheckpoint(L.Callback):
    """SIGTERM and Ctrl-C stop the run within ``stop_grace_s``: a step still generating is
    abandoned at once (its weights are the last step boundary's), a step in its update finishes
    it; the checkpoint is then written. A second signal stops at once, without a checkpoint; a
    stop still unfinished when the grace ends exits the process with one line (what docker and
    SLURM would do next is a SIGKILL). After any exception the module's teardown runs here
    (engines, servers, shared-memory folders): Lightning calls it only when fit ends normally."""

    def __init__(self, stop_grace_s: float = 10.0) -> None:
        if stop_grace_s <= 0:
            raise ConfigError(f"stop_grace_s={stop_grace_s:g}: give the seconds a stop may take (docker stop "
                             "allows 10, SLURM its --signal lead time)")
        self.stop_grace_s = stop_grace_s
        self.interrupted = False
        self.saved: Optional[Path] = None
        self._previous_handlers: dict[int, object] = {}
        self._newest_saved_step: Optional[int] = None  # in this fit
        self._stopping: Optional[tuple[Path, str]] = None  # a stop was asked: (checkpoint, reason)
        self._stop_reason: Optional[str] = None  # the first signal's name, once one came
        self._watchdog: Optional[threading.Timer] = None
        self._trainer: Optional[L.Trainer] = None
        self._module: Optional[L.LightningModule] = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._newest_saved_step = trainer.global_step

    def on_train_start(self, trainer, pl_module) -> None:
        self._newest_saved_step = None
        self._stopping = None
        self._stop_reason = None
        self.interrupted = False
        self._trainer, self._module = trainer, pl_module
        stop.clear()
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:  # SIGTERM: Lightning's handler (it tells the other ranks) is called from ours
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread: keep the default behaviour
                break

    def _on_signal(self, signum, frame) -> None:
        name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        if self._stop_reason is not None:  # the second signal: stop now
            print(f"\n{name} again: stopping now, without a checkpoint", file=sys.stderr, flush=True)
            self._restore_handlers()
            raise KeyboardInterrupt
        self._stop_reason = name
        self.interrupted = True
        previous = self._previous_handlers.get(signum)
        if signum == signal.SIGTERM and callable(previous):
            previous(signum, frame)  # Lightning: trainer.received_sigterm, the launcher's processes told
        stop.request()  # generation in other threads (the asynchronous producer) ends at its next token
        self._watchdog = threading.Timer(self.stop_grace_s, self._grace_ended)
        self._watchdog.daemon = True
        self._watchdog.start()
        trainer, module = self._trainer, self._module
        # the step under way: the module's count of finished steps (Lightning's global_step moves
        # at the update's first optimizer step, before the update ends)
        done = getattr(module, "rollout_steps", None)
        step = (done if done is not None else trainer.global_step if trainer is not None else 0) + 1
        phase = getattr(module, "step_phase", None)
        within = f"within stop_grace_s={self.stop_grace_s:g} s; {'Ctrl-C again' if name == 'Ctrl-C' else 'a second SIGTERM'} stops at once"
        if phase == "update":
            print(f"\n{name}: finishing step {step}'s update, then writing the checkpoint ({within})", file=sys.stderr, flush=True)
            return
        if phase == "rollout":
            print(f"\n{name}: abandoning step {step}'s rollout and writing the state of step {step - 1} ({within})",
                  file=sys.stderr, flush=True)
            raise Stopped(name)  # in the trainer's thread, wherever it waits: the weights are the last boundary's
        if phase == "evaluation":
            print(f"\n{name}: abandoning the evaluation and writing the state of step {step - 1} ({within})",
                  file=sys.stderr, flush=True)
            raise Stopped(name, evaluation=True)
        print(f"\n{name}: writing the checkpoint of step {step - 1} ({within})", file=sys.stderr, flush=True)

    def _grace_ended(self) -> None:
        trainer = self._trainer
        saved = f"the newest checkpoint is {self.saved}" if self.saved else (
            f"nothing was written in this stop; the newest checkpoint is the last periodic one in {checkpoint_dir(trainer)}"
            if trainer is not None else "nothing was written")
        print(f"gspo: the stop did not finish within stop_grace_s={self.stop_grace_s:g} s ({saved}): exiting now",
              file=sys.stderr, flush=True)
        os._exit(0 if self.saved else 1)

    def _end_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._stopping is not None and not trainer.received_sigterm:
            raise Preempted(*self._stopping)
        if self._stop_reason is not None and self._stopping is None:  # asked between steps: none is started
            raise Stopped(self._stop_reason)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # every rank must agree (the checkpoint save is collective)
        asked = trainer.strategy.reduce_boolean_decision(self.interrupted or trainer.received_sigterm, all=False)
        if not asked or self._stopping is not None:
            return
        reason = self._stop_reason or "SIGTERM"
        path = checkpoint_dir(trainer) / "last.ckpt"
        if trainer.checkpoint_callback is None:  # enable_checkpointing=false: the user asked for none
            if trainer.is_global_zero:
                print(f"{reason}: stopped at step {trainer.global_step}; checkpointing is off, nothing was saved", flush=True)
        else:
            trainer.save_checkpoint(path, weights_only=False)
            self.saved = path
            if trainer.is_global_zero:
                print(f"{reason}: checkpoint written to {path} at step {trainer.global_step}; resume with --ckpt_path {path}", flush=True)
        # the run stops once this step is done: its row logged and an evaluation due at this step
        # run (Lightning logs and evaluates after this hook); SIGTERM: Lightning raises itself then
        self._stopping = (path, reason)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._stopping is not None and self.saved is not None and not trainer.sanity_checking:
            from gspo_lightning.run.results import best_checkpoint

            best = best_checkpoint(trainer)
            if best is not None:  # Lightning runs checkpoint callbacks last: let it keep this evaluation first
                best.on_validation_end(trainer, pl_module)
            trainer.save_checkpoint(self.saved, weights_only=False)  # the checkpoint holds this evaluation too (best, results)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_handlers()
        self._end_watchdog()
        callback = trainer.checkpoint_callback
        if callback is None or not getattr(callback, "save_last", False):
            return
        # with nothing saved in this fit, ModelCheckpoint's own on_train_end writes last.ckpt
        if self._newest_saved_step is not None and self._newest_saved_step != trainer.global_step:
            trainer.save_checkpoint(checkpoint_dir(trainer) / "last.ckpt", weights_only=False)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore_handlers()
        try:
            self._checkpoint_after(trainer, pl_module, exception)
        finally:
            if not isinstance(exception, KeyboardInterrupt):  # Lightning tears down after Ctrl-C itself
                with contextlib.suppress(Exception):  # a teardown error must not hide the run's own
                    pl_module.teardown("fit")
            self._end_watchdog()

    def _checkpoint_after(self, trainer, pl_module, exception) -> None:
        if trainer.checkpoint_callback is None:  # enable_checkpointing=false: no checkpoints at all
            if isinstance(exception, Stopped) and trainer.is_global_zero:
                print(f"{exception.reason}: stopped at step {trainer.global_step}; checkpointing is off, nothing was saved", flush=True)
            return
        path = checkpoint_dir(trainer) / "last.ckpt"
        if isinstance(exception, NonFiniteError):
            path = checkpoint_dir(trainer) / "nonfinite.ckpt"
            trainer.save_checkpoint(path, weights_only=False)
            log.error("stopped on non-finite updates; the state is saved in %s for inspection", path)
        elif isinstance(exception, SIGTERMException) and self.saved is None and trainer.global_step > 0:
            # Lightning raises this where its loops look (an evaluation between steps): the state is
            # a step boundary's, and no step boundary wrote it yet
            trainer.save_checkpoint(path, weights_only=False)
            self.saved = path
            if trainer.is_global_zero:
                print(f"SIGTERM: checkpoint written to {path} at step {trainer.global_step}; resume with --ckpt_path {path}",
                      flush=True)
        elif isinstance(exception, Stopped):
            if trainer.global_step == 0:
                if trainer.is_global_zero:
                    print(f"{exception.reason}: stopped in the first step; no step finished, nothing to save", flush=True)
                return
            trainer.save_checkpoint(path, weights_only=False)
            self.saved = path
            if trainer.is_global_zero:
                what = "the evaluation" if exception.evaluation else f"step {trainer.global_step + 1}"
                print(f"{exception.reason}: {what} abandoned; checkpoint written to {path} at step "
                      f"{trainer.global_step}; resume with --ckpt_path {path}", flush=True)
        elif (trainer.global_step > 0 and isinstance(exception, Exception) and not isinstance(exception, Preempted)
              and getattr(pl_module, "step_phase", "update") != "update"):
            # a failure before the step's update (reward functions, agents, environments, engines, a
            # lost rollout server, a bug in the rollout): the weights are the last finished step's
            what, fix = next(((w, f) for kind, w, f in ROLLOUT_FAILURES if isinstance(exception, kind)), (None, None))
            if what is None:
                first_line = str(exception).splitlines()[0] if str(exception) else ""
                what, fix = "the run stopped", "fix the cause, then"
                detail = f" ({type(exception).__name__}: {first_line})"[:300]
            else:
                detail = ""
            trainer.save_checkpoint(path, weights_only=False)
            if trainer.is_global_zero:
                print(f"{what} at step {trainer.global_step + 1}{detail}; the run up to step {trainer.global_step} is saved "
                      f"in {path}: {fix} resume with --ckpt_path {path}", flush=True)
