"""Never lose a run: a checkpoint at the next step boundary on SIGTERM / SIGINT, one at the
end of fit, and one for inspection when training stops on non-finite updates.

``last.ckpt`` is always the newest state of the run: ``ModelCheckpoint`` writes it every
``every_n_train_steps``, this callback on a stop and at the end of fit (``ModelCheckpoint``
alone writes none there once it wrote one during the run), and a resumed run overwrites it
(the CLI turns off ``ModelCheckpoint``'s version counter, which would write ``last-v1.ckpt``).

SIGTERM (preemption, ``scancel``, ``docker stop``) and the first Ctrl-C both let the
current step finish, write ``last.ckpt`` and stop; a second Ctrl-C aborts at once.
Resume with ``gspo fit --config ... --ckpt_path <dir>/last.ckpt``.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Optional

import lightning as L

from gspo_lightning.errors import AgentError, NonFiniteError, RolloutServerError
from gspo_lightning.rewards.base import RewardError

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


class PreemptionCheckpoint(L.Callback):
    def __init__(self) -> None:
        self.interrupted = False
        self.saved: Optional[Path] = None
        self._previous_sigint = None
        self._newest_saved_step: Optional[int] = None  # in this fit
        self._stopping: Optional[tuple[Path, str]] = None  # a stop was asked: (checkpoint, reason)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._newest_saved_step = trainer.global_step

    def on_train_start(self, trainer, pl_module) -> None:
        self._newest_saved_step = None
        self._stopping = None
        self._previous_sigint = signal.getsignal(signal.SIGINT)
        try:
            signal.signal(signal.SIGINT, self._on_sigint)
        except ValueError:  # not the main thread: keep the default behaviour
            self._previous_sigint = None

    def _on_sigint(self, signum, frame) -> None:
        if self.interrupted:  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.interrupted = True
        print("\nCtrl-C: finishing this step and writing a checkpoint (press again to abort at once)", flush=True)

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # every rank must agree (the checkpoint save is collective)
        stop = trainer.strategy.reduce_boolean_decision(self.interrupted or trainer.received_sigterm, all=False)
        if not stop or self._stopping is not None:
            return
        reason = "SIGTERM" if trainer.received_sigterm else "interrupted"
        path = checkpoint_dir(trainer) / "last.ckpt"
        if trainer.checkpoint_callback is None:  # enable_checkpointing=false: the user asked for none
            if trainer.is_global_zero:
                print(f"{reason}: stopped at step {trainer.global_step}; checkpointing is off, nothing was saved", flush=True)
        else:
            trainer.save_checkpoint(path, weights_only=False)
            self.saved = path
            if trainer.is_global_zero:
                print(f"{reason}: checkpoint written to {path} at step {trainer.global_step}; resume with --ckpt_path {path}", flush=True)
        self._restore_sigint()
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

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._stopping is not None and not trainer.received_sigterm:
            raise Preempted(*self._stopping)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_sigint()
        callback = trainer.checkpoint_callback
        if callback is None or not getattr(callback, "save_last", False):
            return
        # with nothing saved in this fit, ModelCheckpoint's own on_train_end writes last.ckpt
        if self._newest_saved_step is not None and self._newest_saved_step != trainer.global_step:
            trainer.save_checkpoint(checkpoint_dir(trainer) / "last.ckpt", weights_only=False)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore_sigint()
        if trainer.checkpoint_callback is None:  # enable_checkpointing=false: no checkpoints at all
            return
        if isinstance(exception, NonFiniteError):
            path = checkpoint_dir(trainer) / "nonfinite.ckpt"
            trainer.save_checkpoint(path, weights_only=False)
            log.error("stopped on non-finite updates; the state is saved in %s for inspection", path)
        elif trainer.global_step > 0 and isinstance(exception, Exception) and not getattr(pl_module, "updating", True):
            # a failure before the step's update (reward functions, agents, environments, engines, a
            # lost rollout server, a bug in the rollout): the weights are the last finished step's
            what, fix = next(((w, f) for kind, w, f in ROLLOUT_FAILURES if isinstance(exception, kind)), (None, None))
            if what is None:
                first_line = str(exception).splitlines()[0] if str(exception) else ""
                what, fix = "the run stopped", "fix the cause, then"
                detail = f" ({type(exception).__name__}: {first_line})"[:300]
            else:
                detail = ""
            path = checkpoint_dir(trainer) / "last.ckpt"
            trainer.save_checkpoint(path, weights_only=False)
            if trainer.is_global_zero:
                print(f"{what} at step {trainer.global_step + 1}{detail}; the run up to step {trainer.global_step} is saved "
                      f"in {path}: {fix} resume with --ckpt_path {path}", flush=True)
