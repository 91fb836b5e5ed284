"""The ``objective`` config block: the policy loss of an update, consumed by ``training/update.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor

from gspo_lightning.objective.loss import make_objective
from gspo_lightning.objective.options import (
    ImportanceSampling, KLEstimator, LossAggMode, OldLogprobs, check_choice,
)
from gspo_lightning.objective.policy import PolicyObjective
from gspo_lightning.objective.ppo import PPOClip
from gspo_lightning.objective.terms import Count


def default_policy_loss() -> PolicyObjective:
    """GSPO's clip: a lazy instance, so the config parser can show it in ``--help`` and ``--print_config``."""
    from jsonargparse import lazy_instance

    return lazy_instance(PPOClip)


@dataclass
class Objective:
    """The policy loss (docs/algorithm.md).

    Args:
        importance_sampling: ``seq`` (GSPO), ``seq-token`` (GSPO-token) or ``token`` (GRPO).
        policy_loss: the objective per unit (token, or response at the sequence levels), one class
            each: ``PPOClip`` (the clipped surrogate of GSPO / GRPO, with ``clip_low``, ``clip_high``,
            ``dual_clip``), ``SAPO`` (a soft gate: ``tau_pos``, ``tau_neg``), ``CISPO`` (the clipped
            ratio as a weight without gradient) or ``GMPO`` (the geometric mean of token ratios, each
            clipped in log space; ``importance_sampling: seq``), or your own subclass of
            ``gspo_lightning.objective.PolicyObjective`` by ``class_path``.
        loss_agg_mode: ``seq-mean-token-mean`` (the paper), ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm``, ``seq-sum-token-sum-norm`` (ROLL's sum-norm) or ``token-mean``.
        old_logprobs: ``recompute`` the old policy's log-probs with the trainer, or take the
            ``engine``'s sampled-token log-probs (no extra pass; the paper's shortcut).
        use_kl_loss: add ``kl_loss_coef * KL(policy, ref)`` to the loss.
        kl_loss_coef: its coefficient.
        kl_estimator: ``k1``, ``k2`` or ``k3`` for both KL terms (this one and ``advantages.add_token_level_kl``'s).
    """

    importance_sampling: ImportanceSampling = "seq"
    policy_loss: PolicyObjective = field(default_factory=default_policy_loss)
    loss_agg_mode: LossAggMode = "seq-mean-token-mean"
    old_logprobs: OldLogprobs = "recompute"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_estimator: KLEstimator = "k3"

    def __post_init__(self) -> None:
        if not isinstance(self.policy_loss, PolicyObjective):  # a name or a checkpoint's {class_path, init_args}
            self.policy_loss = make_objective(self.policy_loss)

    @property
    def kl_coef(self) -> float:
        """The KL term's coefficient in the loss (0: none)."""
        return self.kl_loss_coef if self.use_kl_loss else 0.0

    @property
    def resolved(self) -> PolicyObjective:
        """The per-unit objective with its level's defaults filled in (PPO's clip range)."""
        return self.policy_loss.resolved(self.importance_sampling)

    def problems(self, *, add_token_level_kl: bool) -> list[str]:
        problems = []
        for name, option in (("importance_sampling", ImportanceSampling), ("loss_agg_mode", LossAggMode),
                             ("old_logprobs", OldLogprobs), ("kl_estimator", KLEstimator)):
            try:
                check_choice(name, getattr(self, name), option)
            except ValueError as err:
                problems.append(str(err))
        if self.kl_loss_coef < 0:
            problems.append(f"kl_loss_coef must be >= 0, got {self.kl_loss_coef}")
        if not problems:
            problems += self.policy_loss.problems(importance_sampling=self.importance_sampling,
                                                  add_token_level_kl=add_token_level_kl)
        return problems

    def loss(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
             ref_logprobs: Optional[Tensor] = None, num_seqs: Count = None, num_tokens: Count = None,
             horizon: Optional[int] = None, is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
        """This block's policy loss and metrics (``PolicyObjective.loss``)."""
        return self.resolved.loss(
            logprobs, old_logprobs, advantages, mask, importance_sampling=self.importance_sampling,
            loss_agg_mode=self.loss_agg_mode, ref_logprobs=ref_logprobs, kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator, num_seqs=num_seqs, num_tokens=num_tokens, horizon=horizon, is_weights=is_weights,
        )


__all__ = ["Objective", "default_policy_loss"]
