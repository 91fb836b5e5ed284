"""PPO's clipped surrogate, the objective of GSPO and GRPO (``policy_loss: ppo``), with ROLL's dual clip."""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
from torch import Tensor

from gspo_lightning.errors import ConfigError
from gspo_lightning.objective.policy import MAX_LOG_RATIO, Bound, PolicyObjective, Units, check_non_negative, log1p_bounds

# Clip ranges follow the level of the ratio they clip (GSPO paper, section 5.1 / ROLL).
DEFAULT_CLIP = {"seq": (3e-4, 4e-4), "seq-token": (3e-4, 4e-4), "token": (0.2, 0.27)}


class PPOClip(PolicyObjective):
    """``-min(w A, clip(w, 1 - clip_low, 1 + clip_high) A)`` per unit, with the objective raised
    to ``dual_clip * A`` where ``A < 0`` if ``dual_clip`` is set. Its clip is *active* where it sets
    the gradient to zero: above ``1 + clip_high`` with ``A > 0``, below ``1 - clip_low`` with ``A < 0``.

    Args:
        clip_low: ratio clip below 1 (``null``: 3e-4 at the sequence levels, 0.2 at ``token``).
        clip_high: ratio clip above 1 (``null``: 4e-4 at the sequence levels, 0.27 at ``token``).
        dual_clip: ``c > 1`` bounds the loss of negative-advantage units by ``c * |A|`` (ROLL's
            dual clip; ROLL uses ``1 + 2 * pg_clip``, 3 is usual); ``null``: off.
    """

    name: ClassVar[str] = "ppo"
    LEGACY_KEYS: ClassVar[dict[str, str]] = {"clip_low": "clip_low", "clip_high": "clip_high", "dual_clip": "dual_clip"}

    def __init__(self, clip_low: Optional[float] = None, clip_high: Optional[float] = None,
                 dual_clip: Optional[float] = None):
        check_non_negative(clip_low=clip_low, clip_high=clip_high)
        if dual_clip is not None and not dual_clip > 1:
            raise ConfigError(f"dual_clip must be > 1 (3 is usual) or null, got {dual_clip}")
        self.clip_low, self.clip_high, self.dual_clip = clip_low, clip_high, dual_clip

    def resolved(self, importance_sampling: str) -> "PPOClip":
        low, high = DEFAULT_CLIP[importance_sampling]
        return PPOClip(low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high,
                       self.dual_clip)

    def problems(self, *, importance_sampling: str, add_token_level_kl: bool) -> list[str]:
        # the loss itself takes clip_low >= 1 (no lower bound, as in tests of the formula); a config means a range
        if self.clip_low is not None and self.clip_low >= 1:
            return [f"clip_low must be < 1 (the ratio is clipped at 1 - clip_low), got {self.clip_low}"]
        return super().problems(importance_sampling=importance_sampling, add_token_level_kl=add_token_level_kl)

    def surprises(self, *, importance_sampling: str) -> list[str]:
        if importance_sampling == "token":
            return []
        return [f"{name}={value} with importance_sampling={importance_sampling}: sequence-level ratios stay within "
                f"~1e-3 of 1, so a token-sized clip range almost never clips (the paper uses 3e-4 / 4e-4)"
                for name, value in (("clip_low", self.clip_low), ("clip_high", self.clip_high))
                if value is not None and value >= 0.1]

    def unit_loss(self, logprobs: Tensor, old_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor,
                  units: Units) -> tuple[Tensor, dict[str, Tensor]]:
        ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
        clipped_ratio = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
        dual_active = torch.zeros_like(units.valid)
        if self.dual_clip is not None:
            dual_active = (advantages < 0) & (surrogate < self.dual_clip * advantages) & units.valid
            surrogate = torch.where(dual_active, self.dual_clip * advantages, surrogate)
        ratio, advantages = ratio.detach(), advantages.detach()
        metrics = units.fractions((ratio < 1.0 - self.clip_low) & (advantages < 0),
                                  (ratio > 1.0 + self.clip_high) & (advantages > 0))
        return -surrogate, {**metrics, "dual_clip_frac": units.mean(dual_active), **units.ratio_stats(ratio)}

    def log_bounds(self, unit_adv: Tensor) -> tuple[Bound, Bound]:
        return log1p_bounds(self.clip_low, self.clip_high)


__all__ = ["DEFAULT_CLIP", "PPOClip"]
