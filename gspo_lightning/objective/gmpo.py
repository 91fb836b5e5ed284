"""GMPO: the geometric mean of the token ratios, each clipped in log space (``policy_loss: gmpo``)."""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
from torch import Tensor

from gspo_lightning.objective.policy import MAX_LOG_RATIO, Bound, PolicyObjective, Units, check_non_negative, masked_sequence_mean


class GMPO(PolicyObjective):
    """``-A_i exp(mean_t d'_t)`` on every token of response ``i``, ``d'`` the token log-ratios
    clipped above ``clip_high`` where ``A_i > 0`` and below ``-clip_low`` where ``A_i < 0``
    (``sign(A) min(sign(A) d, sign(A) clamp(d))``): a clipped token adds no gradient, the others
    ``A_i w_i / L_i``. ``A_i`` is the mean of the response's token advantages. Needs
    ``importance_sampling: seq``; the ratio metrics are of the unclipped geometric mean (GSPO's ``s_i``).

    Args:
        clip_low: the token log-ratio's bound below 0 (default 0.4, its paper's and verl's example).
        clip_high: the token log-ratio's bound above 0 (default 0.4).
    """

    name: ClassVar[str] = "gmpo"
    token_flags: ClassVar[bool] = True
    LEGACY_KEYS: ClassVar[dict[str, str]] = {"clip_low": "clip_low", "clip_high": "clip_high"}

    def __init__(self, clip_low: float = 0.4, clip_high: float = 0.4):
        check_non_negative(clip_low=clip_low, clip_high=clip_high)
        self.clip_low, self.clip_high = clip_low, clip_high

    def level_problem(self, importance_sampling: str) -> Optional[str]:
        if importance_sampling != "seq":
            return (f"gmpo's ratio is the geometric mean of the (clipped) token ratios, a sequence ratio: set "
                    f"importance_sampling: seq (got {importance_sampling})")
        return None

    def problems(self, *, importance_sampling: str, add_token_level_kl: bool) -> list[str]:
        problems = super().problems(importance_sampling=importance_sampling, add_token_level_kl=add_token_level_kl)
        if add_token_level_kl:
            problems.append("gmpo weighs each response by one advantage, and add_token_level_kl makes advantages differ "
                            "per token: turn add_token_level_kl off (use_kl_loss adds a KL term) or use another policy objective")
        return problems

    def unit_loss(self, logprobs: Tensor, old_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor,
                  units: Units) -> tuple[Tensor, dict[str, Tensor]]:
        valid = units.valid
        zeros = torch.zeros_like(logprobs)
        seq_adv = masked_sequence_mean(advantages, valid)[:, None]
        sign = torch.sign(seq_adv)
        delta = torch.where(valid, logprobs - old_logprobs, zeros)
        clipped = sign * torch.minimum(sign * delta, sign * delta.clamp(-self.clip_low, self.clip_high))
        log_weight = masked_sequence_mean(clipped, valid)[:, None].clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        token_loss = torch.where(valid, -seq_adv * torch.exp(log_weight), zeros)
        delta, seq_adv = delta.detach(), seq_adv.detach()
        metrics = units.fractions((delta < -self.clip_low) & (seq_adv < 0), (delta > self.clip_high) & (seq_adv > 0))
        ratio = torch.exp(log_ratio.detach().clamp(max=MAX_LOG_RATIO))
        return token_loss, {**metrics, **units.ratio_stats(ratio)}

    def log_bounds(self, unit_adv: Tensor) -> tuple[Bound, Bound]:
        return self.clip_high, -self.clip_low  # already in log space


__all__ = ["GMPO"]
