"""``StrategyOps``: the update loop's optimizer calls (``update.UpdateOps``) on a Lightning strategy.

GSPO optimizes manually (several optimizer steps per ``training_step``). Each call goes
where Lightning expects it, so the strategy and the precision plugin see every backward and
every step:

- ``backward``: ``LightningModule.manual_backward`` (the precision plugin scales the loss),
  times the world size where the strategy averages gradients over ranks (``training/distributed.py``);
- ``step(counted=True)``: Lightning's optimizer wrapper, which advances ``trainer.global_step``
  (once per rollout step); ``step(counted=False)``: ``strategy.optimizer_step``, the same
  step without the count;
- the micro-batch sync context and the loss scale over ranks: ``distributed.GradientSync``;
- clipping and overflow skips under fp16: ``loss_scaling.LossScaling``.
"""

from __future__ import annotations

from typing import ContextManager, Optional, Sequence

import torch
from torch import Tensor

from gspo_lightning.training.distributed import GradientSync, all_reduce_sum, deepspeed_grad_norm
from gspo_lightning.training.loss_scaling import LossScaling
from gspo_lightning.training.update import UpdateOps


class StrategyOps(UpdateOps):
    """Args:
        module: the ``LightningModule`` being trained (its ``manual_backward``; the precision
            plugin's hooks receive it in ``optimizer_step``).
        strategy: the trainer's strategy.
        optimizer: the ``LightningOptimizer`` of ``module.optimizers()``.
        scheduler: stepped after every optimizer step (``None``: none).
        params: the policy's parameters.
        grad_sync: how gradients are summed over ranks (``GradientSync.for_strategy``).
        scaling: the fp16 loss scaler, or an inactive one.
        max_grad_norm: gradient norm clip (``None``: measure only).
    """

    def __init__(self, module, strategy, optimizer, scheduler, params: Sequence[torch.nn.Parameter],
                 grad_sync: GradientSync, scaling: LossScaling, max_grad_norm: Optional[float]):
        super().__init__(params, optimizer, scheduler, max_grad_norm)
        self.module, self.strategy, self.grad_sync, self.scaling = module, strategy, grad_sync, scaling

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return all_reduce_sum(tensor)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def accumulate(self, last: bool) -> ContextManager:
        return self.grad_sync.accumulate(last)

    def backward(self, loss: Tensor) -> None:
        self.module.manual_backward(loss * self.grad_sync.loss_scale)

    def clip_gradients(self) -> Tensor:
        return self.scaling.clip_grad_norm(self.params, self.max_grad_norm, self.grad_sync, self.module.device)

    def step(self, counted: bool) -> Optional[Tensor]:
        if counted:  # through Lightning's wrapper: advances trainer.global_step
            self.optimizer.step()
        else:
            self._uncounted_step()
        if self.scheduler is not None:
            self.scheduler.step()
        return deepspeed_grad_norm(self.strategy.deepspeed_engine) if self.grad_sync.mode == "deepspeed" else None

    def skip_overflow(self) -> Optional[float]:
        return self.scaling.skip_overflow(self._uncounted_step)

    def _uncounted_step(self) -> None:
        """An optimizer step through the strategy and its precision plugin that leaves ``trainer.global_step`` alone."""
        self.strategy.optimizer_step(self.optimizer.optimizer, closure=lambda: None, model=self.module)


__all__ = ["StrategyOps"]
