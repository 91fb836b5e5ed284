"""The ``rollout`` and ``asynchronous`` config blocks: what each step's rollout holds and where it
comes from (``rollout/worker.py``, ``rollout/source.py``, ``rollout/dynamic_sampling.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gspo_lightning.objective.offpolicy import OffPolicyCorrection, check_correction
from gspo_lightning.objective.options import OnRewardError, check_choice
from gspo_lightning.rollout.engine import SamplingParams
from gspo_lightning.rollout.pipeline import StaleRollouts


@dataclass
class RolloutSettings:
    """Each step's rollout: the responses sampled and how they are scored.

    Args:
        num_return_sequences_in_group: responses per prompt, ``G`` (ROLL's key).
        response_length: most new tokens per response (ROLL's key); for episodes, the token budget
            after the prompt.
        temperature: sampling temperature; log-probs are taken at the same temperature.
        top_p: nucleus sampling mass (1: off); log-probs use the same filtered distribution.
        top_k: top-k sampling (0: off); log-probs use the same filtered distribution.
        rollout_seed: base seed of sampling (``null``: the run's ``seed_everything`` seed).
        on_reward_error: ``raise`` stops on a failing reward function; ``zero`` scores 0 and counts.
        score_while_generating: start ``async def`` reward functions (an LLM judge) on each group
            as its responses end, while the others still generate (``HFEngine``); the same scores,
            sooner. ``false``: every reward function after the step's generation.
        dynamic_sampling: DAPO's dynamic sampling: generate more rounds of prompts until the step
            holds ``rollout_batch_size`` groups whose rewards differ (``rollout/dynamic_sampling.py``).
        max_sampling_rounds: extra generation rounds per step at most; when they run out the
            step is filled up with zero-variance groups.
        prompt_length: longest prompt in tokens (the CLI links it from ``data.prompt_length``).
        rollout_batch_size: prompts per step (the CLI links it from ``data.rollout_batch_size``).
    """

    num_return_sequences_in_group: int = 8
    response_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    rollout_seed: Optional[int] = None
    on_reward_error: OnRewardError = "raise"
    score_while_generating: bool = True
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    prompt_length: Optional[int] = None
    rollout_batch_size: Optional[int] = None

    @property
    def params(self) -> SamplingParams:
        """The training rollouts' sampling parameters."""
        return SamplingParams(self.response_length, self.temperature, self.top_p, self.top_k)

    def eval_params(self, temperature: float) -> SamplingParams:
        """Evaluation's: greedy (``temperature`` 0) turns the top-k / top-p filters off."""
        greedy = temperature == 0
        return SamplingParams(self.response_length, temperature, 1.0 if greedy else self.top_p, 0 if greedy else self.top_k)

    def problems(self) -> list[str]:
        problems = []
        try:
            check_choice("on_reward_error", self.on_reward_error, OnRewardError)
        except ValueError as err:
            problems.append(str(err))
        if self.num_return_sequences_in_group < 1:
            problems.append(f"num_return_sequences_in_group must be >= 1, got {self.num_return_sequences_in_group}")
        if self.response_length < 1:
            problems.append(f"response_length must be >= 1, got {self.response_length}")
        if self.temperature <= 0:
            problems.append(f"temperature must be > 0 for training rollouts, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_sampling_rounds < 0:
            problems.append(f"max_sampling_rounds must be >= 0 (extra generation rounds per step), got {self.max_sampling_rounds}")
        if self.dynamic_sampling and self.num_return_sequences_in_group < 2:
            problems.append("dynamic_sampling keeps groups whose rewards differ: set num_return_sequences_in_group >= 2")
        return problems


@dataclass
class Asynchronous:
    """Rollouts generated ahead, and the off-policy correction of what they lag (docs/async.md).

    Args:
        max_staleness: ``k``: generate the rollouts of the next ``k`` steps while this one trains
            (0: synchronous, on-policy; the default). The lag is counted in rollout steps; needs
            an engine with its own weights (``HFCopyEngine`` in float32, ``RemoteEngine``, vLLM).
        stale_rollouts: a rollout more than ``k`` steps old (after a resume with a smaller ``k``):
            ``regenerate`` it with the current weights, or ``reweight`` it (keep it for the
            off-policy correction, which must then be set). Counted as ``async/out_of_window``.
        off_policy: importance correction of the engine (behaviour) policy against the old
            policy (``OffPolicyCorrection``: ``mode`` decoupled / bypass, ``level`` seq / token /
            seq-product, ``method`` truncate / mask, thresholds); ``null``: off.
        clip_budget: log which part of the clipped log-ratio is engine numerics, staleness or
            the update (``clip_budget/*``; for SAPO, of the saturated gate's). Off by default: with
            ``old_logprobs: engine`` it costs one extra no-grad pass per rollout.
    """

    max_staleness: int = 0
    stale_rollouts: StaleRollouts = "regenerate"
    off_policy: Optional[OffPolicyCorrection] = None
    clip_budget: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.off_policy, dict):  # a checkpoint's hyper-parameters
            self.off_policy = OffPolicyCorrection(**self.off_policy)

    def problems(self, *, old_logprobs: str, importance_sampling: str) -> list[str]:
        problems = []
        if self.max_staleness < 0:
            problems.append(f"max_staleness must be >= 0 (0: synchronous), got {self.max_staleness}")
        if self.stale_rollouts not in ("regenerate", "reweight"):
            problems.append(f"stale_rollouts must be 'regenerate' or 'reweight', got {self.stale_rollouts!r}")
        if self.stale_rollouts == "reweight" and self.max_staleness > 0 and self.off_policy is None:
            problems.append("stale_rollouts=reweight keeps too-stale rollouts for the importance correction, and off_policy "
                            "is not set: set off_policy (e.g. {mode: decoupled}) or stale_rollouts=regenerate")
        return problems + check_correction(self.off_policy, old_logprobs=old_logprobs, importance_sampling=importance_sampling)

    def surprises(self, *, old_logprobs: str) -> list[str]:
        if self.max_staleness > 0 and self.off_policy is None and old_logprobs == "recompute":
            return [f"max_staleness={self.max_staleness} with old_logprobs=recompute and no off_policy correction: "
                    f"rollouts up to {self.max_staleness} step(s) old are trained as if the current policy had "
                    f"sampled them (nothing weighs the staleness); set off_policy: {{mode: decoupled}} (or "
                    f"old_logprobs=engine, whose ratio then sees the staleness)"]
        return []


__all__ = ["Asynchronous", "RolloutSettings"]
