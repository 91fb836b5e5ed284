"""Summing over data-parallel ranks: loss statistics, gradients, stop decisions.

A GSPO step runs many backwards inside one ``training_step``, so DDP's reducer around the
LightningModule (whose one forward is the whole step) cannot sync them. Under DDP the
policy's log-prob forward gets a DDP wrapper of its own (:class:`PolicyForward`): every
micro-batch but an optimizer step's last runs inside DDP's ``no_sync()``, and the last
one's backward all-reduces the accumulated gradients bucket by bucket while backward is
still running (it overlaps). DDP averages over ranks, and so do
sharded strategies (FSDP, FSDP2, DeepSpeed); our losses already divide by global counts, so
the loss is scaled by the world size to turn their average into the sum we need.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gspo_lightning.errors import ConfigError


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """The sum over ranks (a copy); the tensor itself on one process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_ranks_true(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank (a collective)."""
    return bool(all_reduce_sum(torch.tensor([0.0 if flag else 1.0], device=device)).item() == 0)


class PolicyForward(nn.Module):
    """``forward(*args) = fn(policy, *args)``: the policy's log-prob function as a module that
    DDP can wrap (DDP prepares its reducer in its own forward)."""

    def __init__(self, policy: nn.Module, fn: Callable):
        super().__init__()
        self.policy = policy
        self.fn = fn

    def forward(self, *args):
        return self.fn(self.policy, *args)


def check_strategy(strategy) -> None:
    """Refuse strategies that cannot run a GSPO step. FSDP1 (``FSDPStrategy``) runs
    ``training_step`` inside its root module's forward, and a backward there fails its state
    check (``Expects BACKWARD_PRE or BACKWARD_POST state but got HandleTrainingState.FORWARD``,
    measured on an H100; Lightning issue #19685). FSDP2 shards the same way and works."""
    from lightning.pytorch.strategies import FSDPStrategy

    if isinstance(strategy, FSDPStrategy):
        raise ConfigError(
            "trainer.strategy FSDPStrategy (FSDP1) cannot train GSPO: a step calls backward inside "
            "training_step, which FSDP1 runs inside its root module's forward, and its first backward fails "
            "(Lightning issue #19685). Use FSDP2 instead: "
            "--trainer.strategy.class_path=lightning.pytorch.strategies.ModelParallelStrategy (docs/scaling.md).")


@dataclass(frozen=True)
class GradientSync:
    """``mode``: ``none`` (one process), ``reducer`` (DDP: ``policy_forward``, a DDP-wrapped
    :class:`PolicyForward`, syncs in the last micro-batch's backward), ``strategy`` (FSDP2
    reduces in backward) or ``deepspeed`` (the engine owns gradients and clipping)."""

    mode: str = "none"
    loss_scale: float = 1.0
    policy_forward: Optional[nn.Module] = None

    @classmethod
    def for_strategy(cls, strategy, world_size: int, policy: nn.Module, logprobs: Callable) -> "GradientSync":
        from lightning.pytorch.strategies import DDPStrategy

        deepspeed = type(strategy).__name__ == "DeepSpeedStrategy"
        if world_size == 1:
            return cls("deepspeed" if deepspeed else "none", 1.0)
        if deepspeed:
            return cls("deepspeed", float(world_size))
        if isinstance(strategy, DDPStrategy):
            # Lightning's reducer stays off for the whole fit (its one forward is a whole step):
            # no_sync() is a context around one forward and backward, and Lightning has no public switch
            strategy.model.require_backward_grad_sync = False
            from torch.nn.parallel import DistributedDataParallel

            # find_unused_parameters: an expert no token of this rank chose still joins the sum
            # (the search runs once per optimizer step, in the synced forward only).
            # gradient_as_bucket_view stays off: with it (this wrapper nested in Lightning's DDP
            # forward, gloo) the 2nd and later optimizer steps sometimes left the ranks with
            # different "all-reduced" gradients, and runs were not repeatable (tests/test_rollout_server.py)
            ddp = DistributedDataParallel(PolicyForward(policy, logprobs), find_unused_parameters=True,
                                          broadcast_buffers=False, gradient_as_bucket_view=False)
            return cls("reducer", float(world_size), ddp)
        return cls("strategy", float(world_size))

    def accumulate(self, last: bool) -> ContextManager:
        """The context of one micro-batch's forward and backward: in ``reducer`` mode DDP's
        ``no_sync()`` unless it is its optimizer step's ``last`` (whose backward all-reduces)."""
        if self.policy_forward is None or last:
            return contextlib.nullcontext()
        return self.policy_forward.no_sync()


def deepspeed_grad_norm(engine) -> Optional[Tensor]:
    """The global gradient norm the DeepSpeed engine measured in its last step (``None``
    before one): DeepSpeed owns the gradients, so ``clip_grad_norm`` cannot measure it."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else torch.as_tensor(float(norm))


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float | None, sync: GradientSync, device) -> Tensor:
    """The total gradient norm, clipped to ``max_norm`` (``None``: measure only)."""
    if sync.mode == "deepspeed":
        # DeepSpeed owns the gradients (set gradient_clipping in its config) and skips
        # overflowing steps itself
        return torch.tensor(0.0, device=device)
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return norm.detach()


__all__ = ["GradientSync", "PolicyForward", "all_ranks_true", "all_reduce_sum", "clip_grad_norm", "deepspeed_grad_norm"]
