"""What a GSPO checkpoint holds beside Lightning's own state, and what it leaves out.

- Frozen weights (the KL reference, LoRA's base model) are not saved: they are the initial
  policy's, rebuilt from ``model_name_or_path`` when the module is built, and put back into
  the loaded state dict (:func:`drop_frozen_weights`, :func:`restore_frozen_weights`). A
  vision-language policy's frozen vision tower is saved.
- ``checkpoint["gspo"]`` (:func:`run_state`): the counters (``policy_version``,
  ``rollout_steps``), the running reward moments, the loggers' version folders (so that
  ``--ckpt_path`` continues them), the updater's skip counters, and every rank's rollouts
  generated ahead and data position (``training/rank_state.py``).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from gspo_lightning.models.lora import frozen_state_keys
from gspo_lightning.models.vision import is_vision_language, vision_tower
from gspo_lightning.training.rank_state import rank_states, restore_rank_state


def _dropped_keys(module: nn.Module) -> set[str]:
    """The frozen weights a checkpoint leaves out: all but the policy's frozen vision tower, which
    is kept (a ``builtin:`` model's random tower could not be rebuilt from its name)."""
    policy = getattr(module, "policy", None)
    tower = vision_tower(policy) if policy is not None and is_vision_language(policy) else None
    kept = set()
    if tower is not None:
        tower_params = {id(p) for p in tower.parameters()}
        kept = {f"policy.{name}" for name, p in policy.named_parameters(remove_duplicate=False) if id(p) in tower_params}
    return frozen_state_keys(module) - kept


def drop_frozen_weights(checkpoint: dict, module: nn.Module) -> None:
    dropped = _dropped_keys(module)
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in dropped}


def restore_frozen_weights(checkpoint: dict, module: nn.Module) -> None:
    """Put the left-out weights back, from the module as rebuilt; a weight the module shares under
    another name that the checkpoint holds (the reference's vision tower is the policy's) takes
    the checkpoint's value, so loading does not write the rebuilt one over it."""
    saved = checkpoint["state_dict"]
    current = module.state_dict(keep_vars=True)
    by_tensor = {id(current[k]): value for k, value in saved.items() if k in current}
    saved.update({k: by_tensor.get(id(v), v.detach()) for k, v in current.items()
                  if k in _dropped_keys(module) and k not in saved})


def logger_identity(logger) -> Optional[dict[str, Any]]:
    """Where a logger writes (``save_dir``, ``name``, ``version``), to resume into the same folder
    (``checkpoint["gspo"]["loggers"]``; the ``gspo`` command continues these version folders)."""
    version = getattr(logger, "version", None)
    save_dir = getattr(logger, "save_dir", None) or getattr(logger, "root_dir", None)
    if version is None or save_dir is None:
        return None
    return {"class": f"{type(logger).__module__}.{type(logger).__qualname__}", "save_dir": str(save_dir),
            "name": getattr(logger, "name", None), "version": version}


def run_state(*, policy_version: int, rollout_steps: int, running_rewards, loggers, updater_state: dict[str, int],
              pending_rollouts: Optional[dict[str, Any]], datamodule) -> dict[str, Any]:
    """``checkpoint["gspo"]`` (a collective: every rank's state is gathered into rank 0's)."""
    return {
        "policy_version": policy_version,
        "rollout_steps": rollout_steps,
        "running_rewards": running_rewards.state_dict(),
        "loggers": [identity for identity in map(logger_identity, loggers) if identity],
        **updater_state,
        # every rank's own rollouts generated ahead and data position: Lightning writes rank 0's dict only
        "ranks": rank_states(pending_rollouts, datamodule),
    }


class CheckpointHooks:
    """``GSPOModule``'s Lightning checkpoint hooks: the frozen weights left out and put back, the run's
    state (:func:`run_state`) saved and restored into the module's counters, updater and rollout source."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        drop_frozen_weights(checkpoint, self)  # the reference, LoRA's base: rebuilt from model_name_or_path on load
        checkpoint["gspo"] = run_state(
            policy_version=self.policy_version, rollout_steps=self.rollout_steps, running_rewards=self.running_rewards,
            loggers=self.trainer.loggers, updater_state=self.updater.state_dict() if self.updater is not None else self._updater_state,
            pending_rollouts=self.rollouts.state_dict() if self.rollouts is not None else None, datamodule=self.trainer.datamodule)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        restore_frozen_weights(checkpoint, self)
        state = checkpoint.get("gspo")
        if state:
            self.policy_version = state["policy_version"]
            self.rollout_steps = state["rollout_steps"]
            self.running_rewards.load_state_dict(state["running_rewards"])
            self._updater_state = {k: state.get(k, 0) for k in ("skipped_updates", "consecutive_nonfinite")}
            if self.updater is not None:
                self.updater.load_state_dict(self._updater_state)
            trainer = self._trainer  # None: loaded outside a fit (load_from_checkpoint)
            self._pending_rollouts = restore_rank_state(checkpoint, self.global_rank, trainer.world_size if trainer else 1,
                                                        trainer.datamodule if trainer else None)
            if self.rollouts is not None and self._pending_rollouts is not None:
                self.rollouts.load_state_dict(self._pending_rollouts, self.device)
                self._pending_rollouts = None
