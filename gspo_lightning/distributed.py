"""Summing over data-parallel ranks: loss statistics, gradients, stop decisions.

A GSPO step runs many backwards inside one ``training_step``. DDP's reducer expects one
backward per forward, so under DDP the gradients stay local and are summed here once per
optimizer step. Sharded strategies (FSDP, FSDP2, DeepSpeed) reduce in backward
themselves, *averaging* over ranks; our losses already divide by global counts, so the
loss is scaled by the world size to turn their average into the sum we need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

BUCKET_BYTES = 64 * 2**20


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """The sum over ranks (a copy); the tensor itself on one process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_ranks_true(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank (a collective)."""
    return bool(all_reduce_sum(torch.tensor([0.0 if flag else 1.0], device=device)).item() == 0)


@dataclass(frozen=True)
class GradientSync:
    """``mode``: ``none`` (one process), ``manual`` (DDP: :meth:`reduce` sums), ``strategy``
    (FSDP/FSDP2 reduce in backward) or ``deepspeed`` (the engine owns gradients and clipping)."""

    mode: str = "none"
    loss_scale: float = 1.0

    @classmethod
    def for_strategy(cls, strategy, world_size: int) -> "GradientSync":
        from lightning.pytorch.strategies import DDPStrategy

        deepspeed = type(strategy).__name__ == "DeepSpeedStrategy"
        if world_size == 1:
            return cls("deepspeed" if deepspeed else "none", 1.0)
        if deepspeed:
            return cls("deepspeed", float(world_size))
        if isinstance(strategy, DDPStrategy):
            strategy.model.require_backward_grad_sync = False  # we sum once per optimizer step
            return cls("manual", 1.0)
        return cls("strategy", float(world_size))

    def reduce(self, params: Iterable[nn.Parameter], finite: bool, device: torch.device) -> bool:
        """Sum gradients over ranks (``manual`` mode) in flat buckets, unless ``finite`` (already
        agreed by every rank) is false; returns ``finite``."""
        if self.mode != "manual" or not finite:
            return finite
        params = [p for p in params if p.requires_grad]
        for p in params:  # a parameter unused on one rank (an idle expert) must still join the sum
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket, size = [], 0
        grads = [p.grad for p in params]
        for grad in grads + [None]:
            if grad is not None:
                bucket.append(grad)
                size += grad.numel() * grad.element_size()
            if bucket and (grad is None or size >= BUCKET_BYTES):
                flat = torch._utils._flatten_dense_tensors(bucket)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                for g, synced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                    g.copy_(synced)
                bucket, size = [], 0
        return True


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


__all__ = ["GradientSync", "all_ranks_true", "all_reduce_sum", "clip_grad_norm", "deepspeed_grad_norm"]
