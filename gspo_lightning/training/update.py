"""The GSPO update of one rollout: ``ppo_epochs`` x mini-batches x micro-batches.

Each mini-batch is one optimizer step. Its micro-batches accumulate gradients with the
loss denominators of the *whole* mini-batch over all ranks (``objective/loss.py``), so the step's
gradient does not depend on how the mini-batch is split into micro-batches or ranks.

The updater knows nothing of Lightning: the module hands it the policy's log-prob
function and the optimizer operations (:class:`UpdateOps`) as explicit arguments.
Extra per-micro-batch metrics plug in through ``metric_hooks`` (see :class:`MicroBatch`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Callable, ContextManager, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from gspo_lightning.errors import ConfigError, NonFiniteError
from gspo_lightning.objective.settings import Objective
from gspo_lightning.objective.terms import masked_sequence_mean
from gspo_lightning.rollout.worker import Rollout
from gspo_lightning.training.metrics import StepMetrics
from gspo_lightning.training.row_filters import loss_mask, micro_batches, rows_with_advantage

log = logging.getLogger(__name__)

Number = Union[Tensor, float]


@dataclass
class Update:
    """The updates of each rollout: epochs, mini-batches, micro-batches, and what they train on.

    Args:
        ppo_epochs: passes over each rollout batch.
        num_mini_batches: optimizer steps per rollout batch and epoch (the paper: 4). Several
            are what let the clip act: with one, every ratio is exactly 1.
        mini_batch_size: responses per optimizer step over all ranks; when set, it takes
            precedence over ``num_mini_batches``.
        micro_batch_size: responses per forward/backward on each rank, also in the no-grad
            old-policy and reference passes (``null``: the fewest equal micro-batches of at most
            8192 tokens, counting ``prompt_length + response_length`` per response; the no-grad
            passes then take up to 8192 tokens per forward across mini-batches); a memory knob
            that leaves the gradient unchanged, except the MoE load-balancing loss, which is a
            mean per micro-batch.
        max_grad_norm: gradient norm clip (``null``: off).
        logprob_chunk_size: response tokens projected to the vocabulary at once (``null``:
            the naive full-logits path).
        max_consecutive_nonfinite: stop after this many skipped (non-finite) updates in a row.
        overlong_filtering: truncated responses (no end before ``response_length``) leave the
            loss and its denominators (DAPO).
        skip_zero_advantage: skip the forward and backward of responses with zero advantage
            when no KL loss or MoE load-balancing loss needs them: the same loss and gradient,
            less work. Off by default: per-update metrics (entropy, clip fractions) then cover
            only the rows trained, and which filler rows run depends on the number of ranks.
        routing_replay: Mixture-of-Experts only: record the experts each token used in the
            old-policy pass and force them in the training forwards (the baseline GRPO needs
            on MoE models). MoE policies always log how much routing changed since the old pass.
        router_aux_loss_coef: Mixture-of-Experts load-balancing loss coefficient (0: off).
        metric_hooks: functions ``hook(MicroBatch) -> {name: (value, weight)}`` adding
            per-update metrics.
    """

    ppo_epochs: int = 1
    num_mini_batches: Optional[int] = 4
    mini_batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None
    max_grad_norm: Optional[float] = 1.0
    logprob_chunk_size: Optional[int] = 512
    max_consecutive_nonfinite: int = 3
    overlong_filtering: bool = False
    skip_zero_advantage: bool = False
    routing_replay: bool = False
    router_aux_loss_coef: float = 0.0
    metric_hooks: Optional[list[Callable]] = None

    def problems(self) -> list[str]:
        problems = []
        if self.ppo_epochs < 1:
            problems.append(f"ppo_epochs must be >= 1, got {self.ppo_epochs}")
        for name in ("num_mini_batches", "mini_batch_size", "micro_batch_size", "logprob_chunk_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 or null, got {getattr(self, name)}")
        if self.mini_batch_size and self.micro_batch_size and self.mini_batch_size % self.micro_batch_size:
            problems.append(f"mini_batch_size={self.mini_batch_size} is not a multiple of micro_batch_size={self.micro_batch_size}")
        if self.router_aux_loss_coef < 0:
            problems.append(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        return problems


@dataclass(frozen=True)
class UpdateSettings:
    """The loss and the loop of one rollout's updates: the ``update`` and ``objective`` blocks with
    the batch plan resolved for this step's size and ranks (:func:`update_settings`)."""

    update: Update
    objective: Objective
    horizon: int  # response_length, the H of seq-mean-token-sum-norm
    mini_batch_size: int  # responses per optimizer step on this rank
    micro_batch_size: int  # responses per forward/backward on this rank
    world_size: int = 1
    no_grad_micro_batch_size: int = 0  # responses per forward of the no-grad passes (0: micro_batch_size)

    @property
    def ppo_epochs(self) -> int:
        return self.update.ppo_epochs


@dataclass(frozen=True)
class MicroBatch:
    """What a metric hook sees after each micro-batch's loss (tensors detached)."""

    rows: Tensor  # (b,) indices into the rollout
    logprobs: Tensor  # (b, T) the policy's, at this update
    old_logprobs: Tensor  # (b, T)
    advantages: Tensor  # (b,) or (b, T)
    mask: Tensor  # (b, T)
    loss_metrics: Mapping[str, Tensor]  # what loss.policy_loss returned
    settings: UpdateSettings


# hook(micro_batch) -> {metric name: (value, weight)}; averaged with these weights over the step
MetricHook = Callable[[MicroBatch], Mapping[str, tuple[Number, Number]]]


class UpdateOps:
    """The optimizer side of an update: every call :class:`PolicyUpdater` makes on the
    gradients, the optimizer and the other ranks. Per optimizer step, in this order:

    1. ``all_reduce_sum(counts)``: the step's loss denominators summed over ranks;
    2. ``zero_grad()``;
    3. per micro-batch: ``with accumulate(last):`` forward, loss, ``backward(loss)``;
    4. ``all_reduce_sum(non_finite)`` (one finite check per step), ``clip_gradients()``;
    5. ``step(counted)``; or, after a non-finite loss or gradient, ``skip_overflow()`` and
       ``zero_grad()``.

    This class is the plain one-process version on a torch optimizer (tests, scripts);
    ``strategy_ops.StrategyOps`` routes the same calls through a Lightning strategy (DDP,
    FSDP, DeepSpeed, fp16 loss scaling).

    Args:
        params: the trained parameters.
        optimizer: steps them (``None``: ``step`` steps nothing, for callers that only read gradients).
        scheduler: stepped after every optimizer step.
        max_grad_norm: ``clip_gradients`` clips the total norm to this (``None``: measures only).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], optimizer: Optional[torch.optim.Optimizer] = None,
                 scheduler=None, max_grad_norm: Optional[float] = None):
        self.params = list(params)
        self.optimizer, self.scheduler, self.max_grad_norm = optimizer, scheduler, max_grad_norm

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over ranks (identity on one process)."""
        return tensor

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def accumulate(self, last: bool) -> ContextManager:
        """The context of one micro-batch's forward and backward; ``last``: the optimizer
        step's last micro-batch (DDP syncs gradients in that backward only)."""
        return contextlib.nullcontext()

    def backward(self, loss: Tensor) -> None:
        """Accumulate the gradient of ``loss`` (already divided by the step's global counts)."""
        loss.backward()

    def clip_gradients(self) -> Tensor:
        """The total gradient norm (in unscaled units), after clipping to ``max_grad_norm``."""
        grads = [p for p in self.params if p.grad is not None]
        limit = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        return torch.nn.utils.clip_grad_norm_(grads, limit).detach()

    def step(self, counted: bool) -> Optional[Tensor]:
        """One optimizer and scheduler step. ``counted`` marks the step that advances the
        trainer's step counter (the first of each rollout). Returns the gradient norm when
        the strategy measured it in the step (DeepSpeed), else ``None``."""
        if self.optimizer is not None:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return None

    def skip_overflow(self) -> Optional[float]:
        """Under a loss scaler (fp16): hand a step whose gradients overflowed to the scaler,
        which skips it and lowers its scale; returns the new scale (``None``: no loss scaler)."""
        return None


# micro_batch_size: null holds at most this many tokens (prompt + response width) per forward
MICRO_BATCH_TOKENS = 8192


def plan_batches(prompts_per_step: int, world: int, *, group_size: int, num_mini_batches: Optional[int],
                 mini_batch_size: Optional[int], micro_batch_size: Optional[int], ppo_epochs: int,
                 warn_no_clip: bool = False, tokens_per_response: Optional[int] = None) -> tuple[int, int]:
    """``(mini, micro)``: responses per optimizer step and per forward on each rank.

    ``mini_batch_size`` (all ranks), when set, takes precedence over ``num_mini_batches``.
    ``micro_batch_size=None`` splits the mini-batch into the fewest equal micro-batches of at
    most :data:`MICRO_BATCH_TOKENS` tokens (``tokens_per_response``: the padded width of a
    row; unknown: the whole mini-batch). Raises when the sizes do not divide the step; warns
    (``warn_no_clip``) when one update per rollout makes every ratio exactly 1."""
    if prompts_per_step % world:
        raise ConfigError(f"data.rollout_batch_size={prompts_per_step} does not split over {world} ranks")
    local = prompts_per_step // world * group_size
    if mini_batch_size is not None:
        if mini_batch_size % world or local % (mini_batch_size // world):
            raise ConfigError(f"mini_batch_size={mini_batch_size} must be a multiple of the {world} rank(s) and divide "
                             f"the {local * world} responses of a step (rollout_batch_size x num_return_sequences_in_group)")
        mini = mini_batch_size // world
    else:
        splits = num_mini_batches or 1
        if local % splits:
            raise ConfigError(f"num_mini_batches={splits} does not divide the {local} responses of a step on each rank "
                             f"(rollout_batch_size x num_return_sequences_in_group / ranks)")
        mini = local // splits
    if micro_batch_size is None and tokens_per_response:
        forwards = -(-mini // max(1, MICRO_BATCH_TOKENS // tokens_per_response))
        micro_batch_size = -(-mini // forwards)  # as even as the count allows
    micro = min(micro_batch_size or mini, mini)  # a last, smaller micro-batch is fine: denominators are global
    if warn_no_clip and ppo_epochs * (local // mini) == 1:
        warnings.warn("one optimizer step per rollout (num_mini_batches=1, ppo_epochs=1) with recomputed old "
                      "log-probs: every importance ratio is exactly 1, so the clip and the dual clip never act. "
                      "The paper splits each rollout into 4 mini-batches: set num_mini_batches: 4", stacklevel=3)
    return mini, micro


def no_grad_micro_batch(micro_batch_size: Optional[int], planned_micro: int, tokens_per_response: Optional[int]) -> int:
    """Responses per forward of a pass without gradients (the old policy's, the reference's).

    Such a pass keeps no activations for a backward, so with ``micro_batch_size`` unset it takes as
    many responses as :data:`MICRO_BATCH_TOKENS` tokens hold, across mini-batch bounds: the
    quickstart's 128 responses in one forward instead of 4 (each forward of a small model costs
    more in dispatch than in arithmetic). A ``micro_batch_size`` the user set is a memory bound and
    holds here too. ``tokens_per_response`` is the configured width, the same on every rank, so
    sharded ranks run as many forwards as each other (``None``: unknown, ``planned_micro``)."""
    if micro_batch_size is not None or not tokens_per_response:
        return planned_micro
    return max(planned_micro, MICRO_BATCH_TOKENS // tokens_per_response)


def update_settings(update: Update, objective: Objective, *, group_size: int, prompt_length: Optional[int],
                    response_length: int, prompts_per_step: int, world: int, warn_no_clip: bool = False,
                    episodes: bool = False) -> UpdateSettings:
    """The update loop's settings: the batch plan of :func:`plan_batches` for ``prompts_per_step``
    prompts over ``world`` ranks, with the blocks. ``episodes``: rows hold several turns, wider than
    ``prompt_length + response_length``, so the no-grad passes keep the planned micro-batches."""
    mini, micro = plan_batches(
        prompts_per_step, world, group_size=group_size, num_mini_batches=update.num_mini_batches,
        mini_batch_size=update.mini_batch_size, micro_batch_size=update.micro_batch_size, ppo_epochs=update.ppo_epochs,
        warn_no_clip=warn_no_clip, tokens_per_response=(prompt_length or 0) + response_length,
    )
    width = None if episodes or not prompt_length else prompt_length + response_length
    return UpdateSettings(update, objective, horizon=response_length, mini_batch_size=mini, micro_batch_size=micro,
                          world_size=world, no_grad_micro_batch_size=no_grad_micro_batch(update.micro_batch_size, micro, width))


class PolicyUpdater:
    """Runs the optimizer steps of one rollout and keeps the non-finite-skip state."""

    def __init__(self, settings: UpdateSettings, metrics: StepMetrics, metric_hooks: Sequence[MetricHook] = ()):
        self.settings = settings
        self.metrics = metrics
        self.metric_hooks = list(metric_hooks)
        self.skipped_updates = 0
        self.consecutive_nonfinite = 0
        self._warned_first_clip = False

    def state_dict(self) -> dict[str, int]:
        return {"skipped_updates": self.skipped_updates, "consecutive_nonfinite": self.consecutive_nonfinite}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))

    def run(
        self,
        rollout: Rollout,
        advantages: Tensor,
        old: Optional[Tensor],
        ref: Optional[Tensor],
        policy_logprobs: Callable[[Tensor], tuple[Tensor, Tensor]],
        ops: UpdateOps,
        *,
        routing_recorder=None,
        generator: Optional[torch.Generator] = None,
        is_weights: Optional[Tensor] = None,
    ) -> int:
        """All updates of one rollout; returns the number of optimizer steps taken.

        ``policy_logprobs(rows) -> (logprobs, entropy)`` runs the policy with grad on rows
        of the rollout. ``old`` is ``None`` when exactly one update follows a recompute (the
        first forward's own log-probs are the old ones). ``routing_recorder`` is the
        MoE ``RoutingRecorder`` when the policy has experts (``models/moe.py``). ``is_weights`` (``(N,)`` or
        ``(N, T)``) are off-policy importance weights multiplying the surrogate (``objective/offpolicy.py``).
        """
        s, u, objective = self.settings, self.settings.update, self.settings.objective
        num = rollout.num_responses
        mask = loss_mask(rollout.response_mask, rollout.truncated, u.overlong_filtering)
        lengths = mask.sum(-1)
        device = mask.device
        # a row adds exactly zero to loss and gradient when its advantage is zero and no other term acts
        exact_zero = u.skip_zero_advantage and objective.kl_coef == 0 and u.router_aux_loss_coef == 0
        teaching = rows_with_advantage(advantages, mask) if exact_zero else None
        steps_taken = 0
        counted = False
        for epoch in range(s.ppo_epochs):
            in_order = s.ppo_epochs == 1 and s.mini_batch_size == num
            order = torch.arange(num) if in_order else torch.randperm(num, generator=generator)
            for mini_index, mini_rows in enumerate(order.to(device).split(s.mini_batch_size)):
                first = epoch == 0 and mini_index == 0  # before any update of this rollout: on-policy
                # denominators of the whole optimizer step, over all ranks
                counts = ops.all_reduce_sum(torch.stack([(lengths[mini_rows] > 0).sum(), mask[mini_rows].sum()]).float())
                ops.zero_grad()
                step_loss = torch.zeros((), device=device)
                records = []
                micros = micro_batches(mini_rows, s.micro_batch_size, teaching, same_count=s.world_size > 1)
                for index, rows in enumerate(micros):
                    with ops.accumulate(last=index == len(micros) - 1):  # DDP: sync (overlapped) in the last backward
                        logprobs, entropy, aux_loss = self._forward(policy_logprobs, rows, rollout.attention_mask[rows], routing_recorder, first)
                        micro_old = old[rows] if old is not None else logprobs.detach()
                        loss, loss_metrics = objective.loss(
                            logprobs, micro_old, advantages[rows], mask[rows],
                            ref_logprobs=ref[rows] if ref is not None else None,
                            num_seqs=counts[0], num_tokens=counts[1], horizon=s.horizon,
                            is_weights=is_weights[rows] if is_weights is not None else None,
                        )
                        if aux_loss is not None:
                            # a mean per micro-batch, weighed by its share of the step's responses over
                            # ALL ranks: the gradients are summed over ranks, so this sums to the mean
                            share = len(rows) / (len(mini_rows) * s.world_size)
                            loss = loss + u.router_aux_loss_coef * aux_loss * share
                        # a non-finite loss runs its backward too: every rank takes as many (sharded
                        # backwards are collective), and the step is skipped below on all ranks at once
                        ops.backward(loss)
                    step_loss += loss.detach()  # no host sync per micro-batch
                    records.append((MicroBatch(rows, logprobs.detach(), micro_old, advantages[rows], mask[rows],
                                               loss_metrics, s), entropy))
                finite = self._finite_everywhere(step_loss, ops)  # one collective per optimizer step
                grad_norm = ops.clip_gradients() if finite else torch.tensor(float("nan"))
                if finite and bool(torch.isfinite(grad_norm)):
                    for micro, entropy in records:
                        self._record(micro, lengths[micro.rows], entropy, first)
                        if first and rollout.engine_logprobs is not None:
                            self._record_mismatch(rollout, micro.rows, micro.logprobs)
                    measured = ops.step(not counted)
                    counted = True
                    steps_taken += 1
                    self.consecutive_nonfinite = 0
                    # DeepSpeed measures the norm in its own step (``clip_gradients`` cannot)
                    self.metrics.update("grad_norm", grad_norm if measured is None else measured)
                    # summed over ranks: each rank's loss already divides by the global counts
                    self.metrics.update("loss/policy", ops.all_reduce_sum(step_loss))
                else:
                    self._skip(ops, gradient_overflow=finite)
        return steps_taken

    # -- pieces --------------------------------------------------------------------------
    def _forward(self, policy_logprobs, rows: Tensor, attention_mask: Tensor, recorder, first: bool):
        """The policy's log-probs with grad; with an MoE routing recorder also the routing change since
        the old-policy pass (measured before a replay overrides it) and the load-balancing loss."""
        u = self.settings.update
        if recorder is None:
            return (*policy_logprobs(rows), None)
        with contextlib.ExitStack() as stack:
            change = stack.enter_context(recorder.measure(rows)) if recorder.has_record and not first else None
            if u.routing_replay:
                stack.enter_context(recorder.replay(rows))
            capture = stack.enter_context(recorder.capture_router_logits()) if u.router_aux_loss_coef > 0 else None
            logprobs, entropy = policy_logprobs(rows)
        if change is not None and change.value is not None:
            self.metrics.update("moe/routing_change", change.value)
        aux = capture.load_balancing_loss(attention_mask) if capture is not None else None
        return logprobs, entropy, aux

    @staticmethod
    def _finite_everywhere(loss: Tensor, ops: UpdateOps) -> bool:
        """Whether the loss is finite on every rank: one all-reduce and one host sync."""
        bad = (~torch.isfinite(loss)).float().reshape(1)
        return bool(ops.all_reduce_sum(bad).item() == 0)

    def _record(self, micro: MicroBatch, lengths: Tensor, entropy: Tensor, first: bool) -> None:
        m = self.metrics
        metrics, mask = micro.loss_metrics, micro.mask
        units = (lengths > 0).sum() if self.settings.objective.importance_sampling != "token" else mask.sum()
        # the objective's own means over units: clip fractions (ppo, cispo, gmpo), the gate's (sapo), ratio_mean
        for name, value in metrics.items():
            if name not in ("kl", "ratio_max", "ratio_min"):
                m.update(f"loss/{name}", value, units)
        if first and "clip_frac" in metrics:  # on-policy: with exact old log-probs nothing can clip here
            m.update("loss/clip_frac_first_minibatch", metrics["clip_frac"], units)
            self._warn_first_clip(float(metrics["clip_frac"]), micro)
        m.update("loss/ratio_max", metrics["ratio_max"], kind="max")
        m.update("loss/ratio_min", metrics["ratio_min"], kind="min")
        if "kl" in metrics:
            m.update("kl", metrics["kl"], mask.sum())
        valid = mask.bool()
        m.update("entropy", entropy[valid].mean() if valid.any() else torch.tensor(float("nan")), valid.sum())
        for hook in self.metric_hooks:
            for name, (value, weight) in hook(micro).items():
                m.update(name, value, weight)

    def _warn_first_clip(self, clip_frac: float, micro: MicroBatch) -> None:
        if clip_frac <= 0 or self._warned_first_clip:
            return
        self._warned_first_clip = True
        valid = micro.mask.bool()
        diff = torch.where(valid, micro.logprobs - micro.old_logprobs, torch.zeros_like(micro.logprobs))
        seq = masked_sequence_mean(diff, valid).abs()
        warnings.warn(
            f"{clip_frac:.1%} of the first mini-batch was clipped before any update: the old log-probs differ from "
            f"the trainer's (mean |token diff| {diff.abs().sum().item() / max(1, int(valid.sum())):.2e}, max |sequence "
            f"log-ratio| {seq.max().item():.2e}; {self.settings.objective.resolved.describe()}). "
            f"With old_logprobs=engine this is the engine/trainer mismatch: use old_logprobs=recompute, or widen the "
            f"clip range above the mismatch. With recompute, the policy is not deterministic in train mode (dropout?).",
            stacklevel=2,
        )

    def _record_mismatch(self, rollout: Rollout, rows: Tensor, trainer_logprobs: Tensor) -> None:
        """How far the engine's sampled-token log-probs are from the trainer's (same weights)."""
        mask = rollout.response_mask[rows]
        diff = torch.where(mask, trainer_logprobs - rollout.engine_logprobs[rows], torch.zeros_like(trainer_logprobs))
        lengths = mask.sum(-1)
        self.metrics.update("engine/logprob_abs_diff", diff.abs().sum() / mask.sum().clamp(min=1), mask.sum())
        seq_log_ratio = masked_sequence_mean(diff, mask)[lengths > 0]
        if seq_log_ratio.numel():
            self.metrics.update("engine/seq_log_ratio_abs_max", seq_log_ratio.abs().max(), kind="max")

    def _skip(self, ops: UpdateOps, gradient_overflow: bool) -> None:
        # a finite loss with an overflowing gradient under a loss scaler (fp16): the scaler's
        # signal to lower its scale, not a failure, while the scale is >= 1 (below, the
        # gradients overflow unscaled)
        scale = ops.skip_overflow() if gradient_overflow else None
        ops.zero_grad()
        self.skipped_updates += 1
        if scale is not None and scale >= 1:
            log.info("the loss scaler skipped an overflowing step and lowered its scale to %g", scale)
            return
        self.consecutive_nonfinite += 1
        log.warning("skipped an update with a non-finite loss or gradient (%d in a row)", self.consecutive_nonfinite)
        if self.consecutive_nonfinite >= self.settings.update.max_consecutive_nonfinite:
            raise NonFiniteError(
                f"{self.consecutive_nonfinite} updates in a row had a non-finite loss or gradient. Lower the learning "
                f"rate, set max_grad_norm, check the reward scale, or raise max_consecutive_nonfinite."
            )


__all__ = ["MetricHook", "MicroBatch", "PolicyUpdater", "Update", "UpdateOps", "UpdateSettings", "plan_batches", "update_settings"]
