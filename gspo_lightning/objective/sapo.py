"""SAPO: a soft gate in place of the clip (``policy_loss: sapo``)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from gspo_lightning.errors import ConfigError
from gspo_lightning.objective.policy import MAX_LOG_RATIO, Bound, PolicyObjective, Units

# a unit is "saturated" where the gate passes less than half of the on-policy gradient
SATURATED_WEIGHT = 0.5
# the gate weight 4 g (1 - g) = sech^2(z / 2), z = tau (w - 1): below SATURATED_WEIGHT where |z| > this
SATURATED_Z = 2.0 * math.acosh(1.0 / math.sqrt(SATURATED_WEIGHT))


class SAPO(PolicyObjective):
    """``-sigmoid(tau (w - 1)) * 4 / tau * A`` per unit, ``tau = tau_pos`` where ``A > 0`` else
    ``tau_neg``. Its gradient is the policy gradient ``w A grad log w`` times ``4 g (1 - g)`` (``g``
    the sigmoid): 1 on-policy, decaying smoothly as ``w`` leaves 1, on both sides and whatever the
    sign of ``A``. ``gate_weight_mean`` is that factor's mean, ``gate_saturated_frac`` the share of
    units where it is below one half. SAPO clips nothing: it has no clip range.

    Args:
        tau_pos: the gate's temperature where the advantage is positive (> 0; the paper: 1.0).
        tau_neg: the same where it is not (> 0; the paper: 1.05).
    """

    name: ClassVar[str] = "sapo"
    trust_region: ClassVar[bool] = False
    clip_metric = None
    LEGACY_KEYS: ClassVar[dict[str, str]] = {"sapo_tau_pos": "tau_pos", "sapo_tau_neg": "tau_neg"}

    def __init__(self, tau_pos: float = 1.0, tau_neg: float = 1.05):
        for key, value in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
            if not value > 0:
                raise ConfigError(f"{key} must be > 0 (the gate's slope; the paper: 1.0 / 1.05), got {value}")
        self.tau_pos, self.tau_neg = tau_pos, tau_neg

    def surprises(self, *, importance_sampling: str) -> list[str]:
        tau = min(self.tau_pos, self.tau_neg)
        if importance_sampling == "token" or tau >= 100:
            return []
        return [f"sapo at importance_sampling={importance_sampling} with a gate temperature of {tau:g}: sequence "
                f"ratios usually stay within ~1e-3 of 1 (GSPO clips at 3e-4 / 4e-4), where the gate passes nearly all of "
                f"the gradient (its weight 4 g (1 - g) is 1/2 only at |tau (s - 1)| = 1.76): sequence-level policy "
                f"gradient without a trust region. A gate acting where GSPO's clip does needs tau of several thousand "
                f"(docs/algorithm.md)"]

    def unit_loss(self, logprobs: Tensor, old_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor,
                  units: Units) -> tuple[Tensor, dict[str, Tensor]]:
        ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        taus = [torch.tensor(t, dtype=ratio.dtype, device=ratio.device) for t in (self.tau_pos, self.tau_neg)]
        tau = torch.where(advantages > 0, *taus)
        gate = torch.sigmoid(tau * (ratio - 1.0))
        token_loss = -(gate * 4.0 / tau) * advantages
        gate, ratio = gate.detach(), ratio.detach()
        weight = 4.0 * gate * (1.0 - gate)
        saturated = weight < SATURATED_WEIGHT
        metrics = units.fractions(saturated & (ratio < 1.0), saturated & (ratio > 1.0), prefix="gate_saturated_frac")
        return token_loss, {**metrics, "gate_weight_mean": units.mean(weight), **units.ratio_stats(ratio)}

    def log_bounds(self, unit_adv: Tensor) -> tuple[Bound, Bound]:
        # the half-weight points, 1 +- 1.763 / tau
        half = SATURATED_Z / torch.where(unit_adv > 0, float(self.tau_pos), float(self.tau_neg))
        lower = torch.where(half < 1, torch.log1p(-half.clamp(max=1 - 1e-7)), torch.full_like(half, -math.inf))
        return torch.log1p(half), lower


__all__ = ["SAPO", "SATURATED_WEIGHT", "SATURATED_Z"]
