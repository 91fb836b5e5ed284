"""Where a training step's rollout comes from: sampled now, or generated ahead.

``max_staleness`` picks the source (:func:`rollout_source`):

- :class:`SynchronousRollouts` (``0``, the default): the step pushes the policy's current
  weights to the engine and samples its own prompts (with dynamic sampling, more rounds
  until its groups' rewards differ). The rollout is on-policy; an engine that reports
  other weights is an error.
- :class:`PipelinedRollouts` (``k >= 1``): the rollout was generated up to ``k`` rollout
  steps ago on the producer thread of a :class:`~gspo_lightning.rollout.pipeline.RolloutPipeline`
  while earlier steps trained.

Both are built from explicit arguments (the worker, the policy's weights, the device, the
seed of a step) and know nothing of Lightning: ``next(step, batch, policy_version)`` is all
a training step calls. ``step`` counts rollout steps (the seed and the staleness window
use it); ``policy_version`` counts optimizer steps (the weights' version, what rollouts are
tagged with).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from gspo_lightning.errors import ConfigError
from gspo_lightning.rollout.dynamic_sampling import DynamicSampler
from gspo_lightning.rollout.engine import RolloutEngine, WeightsSource
from gspo_lightning.rollout.pipeline import RolloutPipeline, StaleRollouts, agree
from gspo_lightning.rollout.worker import Rollout, RolloutWorker

Stats = dict[str, float]


class RolloutSource:
    """A rollout of a prompt batch with the policy's current weights; subclasses add ``next``.

    Args:
        worker: the engine, the reward functions and the sampling settings.
        policy_weights: ``policy_weights()`` iterates the policy's current ``(name, tensor)`` pairs
            (``weight_sync.iter_policy_weights``); called only when the engine needs them.
        device: where the rollout's tensors go.
        seed: ``seed(step)``, the sampling seed of rollout step ``step`` on this rank.
    """

    def __init__(self, worker: RolloutWorker, policy_weights: WeightsSource, device: torch.device, seed: Callable[[int], int]):
        self.worker, self.policy_weights, self.device, self.seed = worker, policy_weights, device, seed

    def rollout(self, batch: dict, seed: int, policy_version: int, evaluation: bool = False) -> Rollout:
        """Push the weights of ``policy_version`` (unless the engine holds them), then sample and score ``batch``."""
        timings = self.worker.sync_weights(policy_version, self.policy_weights)
        rollout = self.worker.rollout(batch, seed=seed, device=self.device, evaluation=evaluation)
        rollout.timings.update(timings)
        return rollout

    def next(self, step: int, batch: dict, policy_version: int) -> tuple[Rollout, Stats]:
        """The rollout rollout step ``step`` trains on (``batch``: its prompts) and the step's metrics."""
        raise NotImplementedError

    def drain(self) -> None:
        """Wait for generation in flight (before the engine gets other weights, e.g. for evaluation)."""

    def state_dict(self) -> Optional[dict[str, Any]]:
        """What a checkpoint must hold to resume this source exactly (``None``: nothing)."""
        return None

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        pass

    def close(self) -> None:
        pass


class SynchronousRollouts(RolloutSource):
    """``max_staleness: 0``: each step samples its own rollout with the current weights.

    Args (beside :class:`RolloutSource`'s):
        sampler: DAPO's dynamic sampling (``None``: off), with ``more_prompts()`` the data
            module's extra prompt stream and ``pad_token_id`` to re-pad the groups it keeps.
        gather: ``gather(value)``: every rank's ``value`` (a collective): a rollout that failed on
            one rank (a reward function, an environment, an agent majority) stops every rank.
    """

    def __init__(self, worker: RolloutWorker, policy_weights: WeightsSource, device: torch.device, seed: Callable[[int], int], *,
                 sampler: Optional[DynamicSampler] = None, more_prompts: Optional[Callable[[], dict]] = None,
                 pad_token_id: int = 0, gather: Optional[Callable[[Any], list]] = None):
        super().__init__(worker, policy_weights, device, seed)
        self.sampler, self.more_prompts, self.pad_token_id = sampler, more_prompts, pad_token_id
        self.gather = gather

    def next(self, step: int, batch: dict, policy_version: int) -> tuple[Rollout, Stats]:
        seed = self.seed(step)
        try:
            if self.sampler is None:
                rollout, stats = self.rollout(batch, seed, policy_version), {}
            else:
                rollout, stats = self.sampler.fill(
                    batch, lambda prompts, round_seed: self.rollout(prompts, round_seed, policy_version), self.more_prompts,
                    seed=seed, pad_token_id=self.pad_token_id)
        except Exception as err:
            if self.gather is None:
                raise
            agree(self.gather, step, err)  # raises on every rank
        if self.gather is not None:
            agree(self.gather, step, None)
        if rollout.policy_version != policy_version:
            raise RuntimeError(f"stale rollout: sampled with policy version {rollout.policy_version}, the policy is at {policy_version}")
        return rollout, stats

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """A checkpoint of an asynchronous run resumed synchronously: its rollouts generated
        ahead are not trained on (they are off-policy now); their prompt batches are sampled
        again with the current weights, so no prompt is skipped. Said once, not done silently."""
        pending = [item["index"] for item in state.get("pending", [])]
        if pending:
            warnings.warn(f"the checkpoint holds {len(pending)} rollout(s) generated ahead (prompt batches {pending}) by a "
                          f"run with max_staleness > 0; with max_staleness: 0 they are sampled again with the current "
                          f"weights instead (resume with the checkpoint's max_staleness to train on them)", stacklevel=2)


class PipelinedRollouts(RolloutSource):
    """``max_staleness: k >= 1``: rollouts generated ahead on a producer thread (``pipeline.py``).

    Args (beside :class:`RolloutSource`'s):
        batch_at: ``batch_at(index)``, the prompt batch of a future step (``PromptDataModule.train_batch``).
        max_staleness / stale_rollouts: the window and what happens to a rollout beyond it.
        behaviour_logprobs: ``behaviour_logprobs(model, rollout)``, the trainer's log-probs of a
            rollout under ``model``: when set and the engine is an exact float32 copy of the
            policy, the producer also takes them at the sampling weights (the clip budget's ``o_b``).
        gather: ``gather(value)``: every rank's ``value`` (a collective on the training thread;
            ``training.rank_state.gather_objects``): ranks stop together when one rank's rollout failed.
    """

    def __init__(self, worker: RolloutWorker, policy_weights: WeightsSource, device: torch.device, seed: Callable[[int], int], *,
                 batch_at: Callable[[int], dict], max_staleness: int, stale_rollouts: StaleRollouts = "regenerate",
                 behaviour_logprobs: Optional[Callable[[nn.Module, Rollout], Tensor]] = None,
                 gather: Callable[[Any], list] = lambda value: [value]):
        super().__init__(worker, policy_weights, device, seed)
        exact = is_exact_float32_copy(worker.engine)
        self.behaviour_logprobs = behaviour_logprobs if exact else None
        self.pipeline = RolloutPipeline(self._produce, batch_at, max_staleness, stale_rollouts, gather)

    def _produce(self, batch: dict, index: int) -> Rollout:
        """On the producer thread: the rollout of prompt batch ``index`` with the engine's current weights."""
        rollout = self.worker.rollout(batch, seed=self.seed(index), device=self.device, evaluation=False)
        if self.behaviour_logprobs is not None:
            rollout.behaviour_trainer_logprobs = self.behaviour_logprobs(self.worker.engine.model, rollout)
        return rollout

    def next(self, step: int, batch: dict, policy_version: int) -> tuple[Rollout, Stats]:
        rollout, stats = self.pipeline.next(step, batch, lambda: self.worker.capture_weights(policy_version, self.policy_weights),
                                            policy_version)
        stats["async/lag_versions"] = float(policy_version - rollout.policy_version)
        return rollout, stats

    def drain(self) -> None:
        self.pipeline.drain()

    def state_dict(self) -> dict[str, Any]:
        return self.pipeline.state_dict()

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.pipeline.load_state_dict(state, device)

    def close(self) -> None:
        self.pipeline.close()


def is_exact_float32_copy(engine: RolloutEngine) -> bool:
    """Whether the engine samples from an unquantized float32 copy of the policy (``HFCopyEngine(dtype="float32")``)."""
    return getattr(engine, "dtype", None) == "float32" and getattr(engine, "weight_quantization", 1) is None


def rollout_source(worker: RolloutWorker, policy_weights: WeightsSource, device: torch.device, seed: Callable[[int], int], *,
                   max_staleness: int = 0, stale_rollouts: StaleRollouts = "regenerate", datamodule: Any = None,
                   dynamic_sampling_rounds: Optional[int] = None, sharded: bool = False, pad_token_id: int = 0,
                   behaviour_logprobs: Optional[Callable[[nn.Module, Rollout], Tensor]] = None,
                   gather: Callable[[Any], list] = lambda value: [value], world_size: int = 1) -> RolloutSource:
    """The source ``max_staleness`` asks for; one-line errors for what cannot work with it.

    ``datamodule`` provides ``train_batch(index)`` (prompts of future steps, ``k >= 1``) and
    ``extra_batch()`` (dynamic sampling's extra rounds, ``dynamic_sampling_rounds`` set)."""
    # the ranks' agreement on each rollout costs a collective a step: only where there are ranks
    agreement = gather if world_size > 1 else None
    if max_staleness == 0:
        if dynamic_sampling_rounds is None:
            return SynchronousRollouts(worker, policy_weights, device, seed, gather=agreement)
        more_prompts = getattr(datamodule, "extra_batch", None)
        if more_prompts is None or sharded:
            raise ConfigError("model.dynamic_sampling needs the PromptDataModule (its extra prompt stream) and an "
                             "unsharded policy (ranks generate different numbers of rounds): turn it off or use data: "
                             "PromptDataModule without FSDP")
        return SynchronousRollouts(worker, policy_weights, device, seed, sampler=DynamicSampler(dynamic_sampling_rounds),
                                   more_prompts=more_prompts, pad_token_id=pad_token_id, gather=agreement)
    engine = worker.engine
    if engine.shares_policy_weights:
        raise ConfigError(f"max_staleness={max_staleness} generates while the policy trains, but {type(engine).__name__} "
                         f"samples from the policy's own weights: use an engine with its own copy "
                         f"(gspo_lightning.rollout.HFCopyEngine with dtype float32, or VLLMEngine) or max_staleness: 0")
    batch_at = getattr(datamodule, "train_batch", None)
    if batch_at is None:
        raise ConfigError("max_staleness > 0 reads the prompt batches of future steps with the data module's "
                         "train_batch(index): use gspo_lightning.data.PromptDataModule (or give yours that method)")
    return PipelinedRollouts(worker, policy_weights, device, seed, batch_at=batch_at, max_staleness=max_staleness,
                             stale_rollouts=stale_rollouts, behaviour_logprobs=behaviour_logprobs, gather=gather)


__all__ = ["PipelinedRollouts", "RolloutSource", "SynchronousRollouts", "is_exact_float32_copy", "rollout_source"]
