"""CISPO (MiniMax-M1): the clipped importance ratio as a weight without gradient (``policy_loss: cispo``)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from gspo_lightning.objective.policy import MAX_LOG_RATIO, Bound, PolicyObjective, Units, check_non_negative, log1p_bounds


class CISPO(PolicyObjective):
    """``-sg(clip(w, max(0, 1 - clip_low), 1 + clip_high)) A lp`` per unit: the REINFORCE gradient
    ``A grad lp`` weighted by the bounded ratio, so the clip bounds each token's weight and zeroes
    none. A unit is *clipped* where its weight was bounded, whatever the sign of ``A``.

    Args:
        clip_low: the weight's bound below 1 (default 1: no lower bound; MiniMax-M1 set it large).
        clip_high: the weight's bound above 1 (default 4: the ratio capped at 5, ScaleRL's
            epsilon_max and TRL's recommended epsilon_high).
    """

    name: ClassVar[str] = "cispo"
    trust_region: ClassVar[bool] = False
    LEGACY_KEYS: ClassVar[dict[str, str]] = {"clip_low": "clip_low", "clip_high": "clip_high"}

    def __init__(self, clip_low: float = 1.0, clip_high: float = 4.0):
        check_non_negative(clip_low=clip_low, clip_high=clip_high)
        self.clip_low, self.clip_high = clip_low, clip_high

    def unit_loss(self, logprobs: Tensor, old_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor,
                  units: Units) -> tuple[Tensor, dict[str, Tensor]]:
        ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO)).detach()
        weight = ratio.clamp(max(0.0, 1.0 - self.clip_low), 1.0 + self.clip_high)
        metrics = units.fractions(ratio < 1.0 - self.clip_low, ratio > 1.0 + self.clip_high)
        return -weight * advantages * logprobs, {**metrics, **units.ratio_stats(ratio)}

    def log_bounds(self, unit_adv: Tensor) -> tuple[Bound, Bound]:
        return log1p_bounds(self.clip_low, self.clip_high)


__all__ = ["CISPO"]
