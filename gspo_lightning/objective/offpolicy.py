"""Off-policy correction: the engine sampled, the trainer updates another policy.

The behaviour policy ``mu`` is the engine at the version that generated the rollout (its
sampled-token log-probs ``b``); the old (proximal) policy is the trainer at the start of
this update (its recomputed log-probs ``o``). They differ by engine numerics and, with
``max_staleness > 0``, by the updates made since generation. Two ways to live with it:

- ``decoupled`` (AReaL): the loss clips ``lp - o`` (``old_logprobs: recompute``) and each
  unit's surrogate is multiplied by an importance weight of ``o`` against ``b``;
- ``bypass``: ``b`` *is* the old policy (``old_logprobs: engine``): one ratio ``lp - b``
  carries numerics, staleness and the update together; no extra weight. The weights are
  still computed, for the metrics.

Weights (``level``), from ``d[i,t] = o[i,t] - b[i,t]`` on valid tokens:

- ``token``: ``w[i,t] = exp(d[i,t])``;
- ``seq``: ``w_i = exp((1/L_i) sum_t d[i,t])``, the length-normalized geometric mean:
  GSPO's own semantics, one range for every length;
- ``seq-product``: ``w_i = exp(sum_t d[i,t])``, TRL's "sequence" correction; it grows with
  the length (a 4k-token response with a 1e-3 mean gap weighs e^4).

Bounding (``method``): ``truncate`` (TIS) uses ``min(w, truncate_at)``; ``mask`` (MIS /
IcePop) sets ``w = 0`` outside ``[mask_low, mask_high]`` and keeps it inside.

Everything here is a pure function of tensors: tested against hand-worked values.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch
from torch import Tensor

from gspo_lightning.errors import ConfigError
from gspo_lightning.objective.terms import masked_sequence_mean

CorrectionMode = Literal["decoupled", "bypass"]
WeightLevel = Literal["token", "seq", "seq-product"]
BoundMethod = Literal["truncate", "mask"]

# exp() of a log-weight above this is inf in float32; the weight is bounded afterwards anyway
MAX_LOG_WEIGHT = 20.0


@dataclass(frozen=True)
class OffPolicyCorrection:
    """Importance correction of the behaviour (engine) policy against the old policy.

    Args:
        mode: ``decoupled`` (clip on ``lp - o``, multiply by the weight; needs
            ``old_logprobs: recompute``) or ``bypass`` (``b`` is the old policy, no weight;
            needs ``old_logprobs: engine``).
        level: ``seq`` (default: the geometric mean, GSPO's semantics, so one threshold fits
            every length), ``token`` (per-token weights, for token-level losses), or
            ``seq-product`` (the product over tokens, as TRL's ``sequence_*`` modes).
        method: ``truncate`` (TIS, ``min(w, truncate_at)``; default: keeps every sample, bias
            only where a weight is large) or ``mask`` (MIS / IcePop, ``w = 0`` outside
            ``[mask_low, mask_high]``).
        truncate_at: TIS cap ``C``. Default 2.0, the value of the truncated-IS paper
            (Yao et al., 2025) and verl's ``rollout_is_threshold``: the weight can at most
            double a sample's say, so one outlier cannot dominate a step.
        mask_low, mask_high: MIS / IcePop bounds. Default ``[0.5, 2.0]``: symmetric in log
            space (``|log w| <= log 2``); a sample whose behaviour and old probabilities differ
            by more than a factor 2 is treated as broken (IcePop used ``[0.5, 5]``).
    """

    mode: CorrectionMode = "decoupled"
    level: WeightLevel = "seq"
    method: BoundMethod = "truncate"
    truncate_at: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 2.0

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError("invalid off_policy correction: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        for name, value, valid in (("mode", self.mode, ("decoupled", "bypass")),
                                   ("level", self.level, ("token", "seq", "seq-product")),
                                   ("method", self.method, ("truncate", "mask"))):
            if value not in valid:
                out.append(f"off_policy.{name} must be one of {', '.join(valid)}; got {value!r}")
        if not self.truncate_at > 0:
            out.append(f"off_policy.truncate_at must be > 0 (2.0 is usual), got {self.truncate_at}")
        if not 0 <= self.mask_low < self.mask_high:
            out.append(f"off_policy.mask_low / mask_high must satisfy 0 <= low < high, got {self.mask_low} / {self.mask_high}")
        return out


def check_correction(correction: Optional[OffPolicyCorrection], *, old_logprobs: str, importance_sampling: str) -> list[str]:
    """Problems of a correction with the rest of the config (errors); warns once about
    combinations that run but do not mean what they seem."""
    if correction is None:
        return []
    problems = []
    if correction.mode == "decoupled" and old_logprobs != "recompute":
        problems.append("off_policy.mode=decoupled weighs the recomputed old policy against the engine: "
                        "set old_logprobs=recompute (or off_policy.mode=bypass)")
    if correction.mode == "bypass" and old_logprobs != "engine":
        problems.append("off_policy.mode=bypass takes the engine's log-probs as the old policy: "
                        "set old_logprobs=engine (or off_policy.mode=decoupled)")
    if not problems and correction.mode == "decoupled" and correction.level != "token" and importance_sampling == "token":
        warnings.warn(f"off_policy.level={correction.level} with importance_sampling=token: the loss clips each token "
                      f"on its own but the correction weighs whole sequences, so one bad token reweights its "
                      f"neighbours; off_policy.level=token matches a token-level loss", stacklevel=3)
    return problems


def log_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, level: str) -> Tensor:
    """Log importance weights: ``(B, T)`` for ``token``, ``(B,)`` for the sequence levels
    (0 for a response with no valid token)."""
    valid = mask.bool()
    diff = torch.where(valid, old_logprobs.float() - behaviour_logprobs.float(), torch.zeros_like(old_logprobs, dtype=torch.float32))
    if level == "token":
        return diff
    total = diff.sum(-1)
    if level == "seq-product":
        return total
    if level == "seq":
        return masked_sequence_mean(diff, valid)
    raise ConfigError(f"off_policy.level must be token, seq or seq-product; got {level!r}")


def bound_weights(log_w: Tensor, correction: OffPolicyCorrection) -> tuple[Tensor, Tensor, Tensor]:
    """``(bounded weights, raw weights, bounded flags)``: TIS truncates, MIS zeroes."""
    raw = torch.exp(log_w.clamp(max=MAX_LOG_WEIGHT))
    if correction.method == "truncate":
        flags = raw > correction.truncate_at
        return raw.clamp(max=correction.truncate_at), raw, flags
    flags = (raw < correction.mask_low) | (raw > correction.mask_high)
    return torch.where(flags, torch.zeros_like(raw), raw), raw, flags


@dataclass
class Correction:
    """What the loop needs from one rollout's correction."""

    weights: Optional[Tensor]  # (N,) or (N, T) multiplier of the surrogate; None in bypass
    metrics: dict[str, float]


def correct(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, correction: OffPolicyCorrection,
            reduce_sum: Optional[Callable[[Tensor], Tensor]] = None) -> Correction:
    """The weights of one rollout and their metrics.

    Metrics (over tokens for ``token``, over responses with a valid token otherwise):
    ``weight_mean`` / ``weight_max`` of the raw weights, ``bounded_frac`` (truncated or
    masked), and ``ess``: the normalized effective sample size ``(sum w)^2 / (n sum w^2)``
    of the bounded weights (1: all equal; 1/n: one sample carries everything), over the
    whole batch: ``reduce_sum`` (the sum over data-parallel ranks; a collective every rank
    calls) adds up ``sum w``, ``sum w^2`` and ``n`` of all ranks, not a mean of per-rank sizes.
    ``metrics["units"]`` is this rank's count, the weight of its means.
    """
    valid = mask.bool()
    log_w = log_weights(old_logprobs, behaviour_logprobs, mask, correction.level)
    bounded, raw, flags = bound_weights(log_w, correction)
    units = valid if correction.level == "token" else valid.any(-1)
    metrics = weight_metrics(bounded[units], raw[units], flags[units], reduce_sum)
    if correction.level == "token":
        bounded = torch.where(valid, bounded, torch.zeros_like(bounded))
    return Correction(weights=bounded if correction.mode == "decoupled" else None, metrics=metrics)


def importance_weights(old_logprobs: Optional[Tensor], behaviour_logprobs: Tensor, mask: Tensor,
                       correction: Optional[OffPolicyCorrection], metrics,
                       reduce_sum: Optional[Callable[[Tensor], Tensor]] = None) -> Optional[Tensor]:
    """One rollout's weights for the update (``None``: no correction set, bypass, or no trainer
    log-probs ``o`` to weigh against), with their metrics added to ``metrics`` (a
    ``StepMetrics``) as ``off_policy/*``."""
    if correction is None or old_logprobs is None:
        return None
    result = correct(old_logprobs, behaviour_logprobs, mask, correction, reduce_sum)
    units = result.metrics.pop("units", 0.0)
    for name, value in result.metrics.items():
        # means weighted by this rank's units: the batch's mean over ranks (the ESS is the same on every rank)
        metrics.update(f"off_policy/{name}", value, weight=units if name in ("weight_mean", "bounded_frac") else 1.0,
                       kind="max" if name == "weight_max" else "mean")
    return result.weights


def weight_metrics(bounded: Tensor, raw: Tensor, flags: Tensor,
                   reduce_sum: Optional[Callable[[Tensor], Tensor]] = None) -> dict[str, float]:
    """The metrics of one rollout's weights (see :func:`correct`); ``reduce_sum`` sums over ranks
    (every rank calls it, also one with no unit); this rank's means are NaN without units."""
    n = bounded.numel()
    sums = torch.stack([bounded.double().sum(), bounded.double().square().sum(),
                        torch.tensor(float(n), dtype=torch.float64, device=bounded.device)])
    total, sum_sq, count = (float(v) for v in (reduce_sum(sums) if reduce_sum is not None else sums))
    if count == 0:
        return {}
    nan = float("nan")  # ignored by the means and the max over ranks
    return {
        "weight_mean": float(raw.mean()) if n else nan,
        "weight_max": float(raw.max()) if n else nan,
        "bounded_frac": float(flags.float().mean()) if n else nan,
        # all weights masked: no sample left, an effective size of 0
        "ess": total ** 2 / (count * sum_sq) if sum_sq > 0 else 0.0,
        "units": float(n),
    }


def effective_sample_size(weights: Tensor) -> float:
    """``(sum w)^2 / sum w^2`` (unnormalized; divide by ``n`` for a fraction)."""
    sum_sq = float(weights.square().sum())
    return float(weights.sum()) ** 2 / sum_sq if sum_sq > 0 else 0.0


__all__ = [
    "BoundMethod", "Correction", "CorrectionMode", "OffPolicyCorrection", "WeightLevel", "bound_weights",
    "check_correction", "correct", "effective_sample_size", "importance_weights", "log_weights", "weight_metrics",
]
