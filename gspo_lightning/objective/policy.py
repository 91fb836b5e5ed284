"""What every per-unit policy objective shares: the base class and the units its metrics count.

An objective (``ppo.py``, ``sapo.py``, ``cispo.py``, ``gmpo.py``, or a user's own class chosen by
``class_path``) is one class holding its settings, their defaults and checks, its per-unit loss
(:meth:`PolicyObjective.unit_loss`) and what the clip budget needs to attribute its saturation
(:meth:`PolicyObjective.log_bounds`). The loss around it (ratios, off-policy weights, the KL
term, aggregation) is :meth:`PolicyObjective.loss`, the same for all.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Optional, Union

import torch
from torch import Tensor

from gspo_lightning.errors import ConfigError
from gspo_lightning.objective.terms import (
    MAX_LOG_RATIO, Count, aggregate_loss, kl_penalty, log_importance_ratio, masked_sequence_mean,
)

Bound = Union[float, Tensor]


class Units:
    """What the metrics count: tokens (``token``), or responses (the sequence levels), where
    a response's flag is the share of its tokens flagged (0 or 1 when they all agree)."""

    def __init__(self, valid: Tensor, importance_sampling: str):
        self.valid = valid
        self.per_token = importance_sampling == "token"
        self.count = valid.sum().clamp(min=1) if self.per_token else valid.any(-1).sum().clamp(min=1)

    def mean(self, values: Tensor) -> Tensor:
        """The mean over units of ``(B, T)`` per-token ``values`` (flags or numbers)."""
        values = torch.where(self.valid, values.detach().to(torch.float32), torch.zeros((), device=values.device))
        if self.per_token:
            return values.sum() / self.count
        return masked_sequence_mean(values, self.valid).sum() / self.count

    def ratio_stats(self, ratio: Tensor) -> dict[str, Tensor]:
        """Mean, min and max of one ratio per unit (``ratio``: ``(B, T)``, a sequence's on each token)."""
        ratio = ratio.detach()
        if self.per_token:
            ratios = ratio[self.valid]
        else:
            first = self.valid.float().argmax(-1)
            ratios = ratio.gather(-1, first[:, None]).squeeze(-1)[self.valid.any(-1)]
        if ratios.numel() == 0:
            ratios = torch.ones(1, device=ratio.device)
        ratios = ratios.float()
        return {"ratio_mean": ratios.mean(), "ratio_min": ratios.min(), "ratio_max": ratios.max()}

    def fractions(self, low: Tensor, high: Tensor, prefix: str = "clip_frac") -> dict[str, Tensor]:
        """``prefix``, ``prefix_low`` and ``prefix_high``: the share of units flagged on each side."""
        low_frac, high_frac = self.mean(low & self.valid), self.mean(high & self.valid)
        return {prefix: low_frac + high_frac, f"{prefix}_low": low_frac, f"{prefix}_high": high_frac}


class PolicyObjective:
    """The base of the per-unit objectives. A subclass sets :attr:`name`, takes its settings in
    ``__init__`` (checking each value there) and implements :meth:`unit_loss` and :meth:`log_bounds`;
    :meth:`problems` and :meth:`surprises` check it against the rest of the configuration."""

    name: ClassVar[str] = ""
    # the clip budget flags a unit only on the side its advantage pushes towards (a trust region:
    # ppo, gmpo), or on either side (cispo's bounded weight, sapo's gate)
    trust_region: ClassVar[bool] = True
    # flags live on tokens even at the sequence levels, a response counting its share (gmpo)
    token_flags: ClassVar[bool] = False
    # old flat config keys (``clip_low``, ``sapo_tau_pos``...) -> this class's arguments (training/flat_keys.py)
    LEGACY_KEYS: ClassVar[dict[str, str]] = {}

    def settings(self) -> dict[str, Any]:
        """The constructor's arguments (a checkpoint's hyper-parameters rebuild the objective from them)."""
        return {key: value for key, value in vars(self).items() if not key.startswith("_")}

    def resolved(self, importance_sampling: str) -> "PolicyObjective":
        """This objective with its defaults that depend on the ratio level filled in."""
        return self

    def level_problem(self, importance_sampling: str) -> Optional[str]:
        """Why this objective cannot be computed at ``importance_sampling``'s ratio level (None: it can)."""
        return None

    def problems(self, *, importance_sampling: str, add_token_level_kl: bool) -> list[str]:
        """What cannot act as written next to the rest of the configuration (one line each)."""
        problem = self.level_problem(importance_sampling)
        return [problem] if problem else []

    def surprises(self, *, importance_sampling: str) -> list[str]:
        """Legal settings that rarely mean what their author wanted (warned once)."""
        return []

    def describe(self) -> str:
        """The settings in a few words, for messages."""
        return ", ".join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
                         for key, value in self.settings().items())

    def unit_loss(self, logprobs: Tensor, old_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor,
                  units: Units) -> tuple[Tensor, dict[str, Tensor]]:
        """The ``(B, T)`` per-token loss and this objective's metrics. Inputs are sanitized
        (zero at masked positions); ``log_ratio`` is at the configured level."""
        raise NotImplementedError

    def log_bounds(self, unit_adv: Tensor) -> tuple[Bound, Bound]:
        """The log-ratio bounds beyond which the clip budget flags a unit (``-inf``: no lower bound)."""
        raise NotImplementedError

    def loss(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        importance_sampling: str = "seq",
        loss_agg_mode: str = "seq-mean-token-mean",
        ref_logprobs: Optional[Tensor] = None,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        num_seqs: Count = None,
        num_tokens: Count = None,
        horizon: Optional[int] = None,
        is_weights: Optional[Tensor] = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy loss (to minimize) and its diagnostics: this objective's per-token loss at
        ``importance_sampling``'s ratio, times the off-policy ``is_weights``, plus ``kl_coef * KL``,
        aggregated by ``loss_agg_mode`` (see ``objective/loss.py``'s :func:`policy_loss` for every argument).
        Call it on :meth:`resolved` objectives (their level's defaults filled in)."""
        if mask.dim() != 2 or logprobs.shape != mask.shape or old_logprobs.shape != mask.shape:
            raise ConfigError(
                f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
                f"{tuple(mask.shape)} must all be (B, T)"
            )
        if tuple(advantages.shape) not in (tuple(mask.shape[:1]), tuple(mask.shape)):
            raise ConfigError(f"advantages {tuple(advantages.shape)} must be (B,) = {tuple(mask.shape[:1])} or (B, T) = {tuple(mask.shape)}")
        if ref_logprobs is not None and ref_logprobs.shape != mask.shape:
            raise ConfigError(f"ref_logprobs {tuple(ref_logprobs.shape)} must be (B, T) = {tuple(mask.shape)}")
        if kl_coef != 0.0 and ref_logprobs is None:
            raise ConfigError("kl_coef is set but ref_logprobs is None: pass the reference log-probs or set kl_coef=0")
        valid = mask.bool()
        zeros = torch.zeros_like(logprobs)
        # Sanitize first: a NaN at a masked position would otherwise come back as 0 * NaN = NaN
        # in the backward pass of any later elementwise op.
        logprobs = torch.where(valid, logprobs, zeros)
        old_logprobs = torch.where(valid, old_logprobs.to(logprobs.dtype), zeros)
        if ref_logprobs is not None:
            ref_logprobs = torch.where(valid, ref_logprobs.to(logprobs.dtype), zeros)
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(logprobs)
        advantages = torch.where(valid, advantages.to(logprobs.dtype), zeros)

        log_ratio = log_importance_ratio(logprobs, old_logprobs, mask, importance_sampling)
        token_loss, metrics = self.unit_loss(logprobs, old_logprobs, log_ratio, advantages, Units(valid, importance_sampling))
        if is_weights is not None:
            weights = is_weights.detach().to(logprobs.dtype)
            token_loss = token_loss * (weights[:, None] if weights.dim() == 1 else torch.where(valid, weights, zeros))

        kl = None
        if ref_logprobs is not None:
            kl = torch.where(valid, kl_penalty(logprobs, ref_logprobs, kl_estimator), zeros)
            if kl_coef != 0.0:
                token_loss = token_loss + kl_coef * kl

        loss = aggregate_loss(
            token_loss, mask, loss_agg_mode, num_seqs=num_seqs, num_tokens=num_tokens, horizon=horizon
        )
        if kl is not None:
            metrics["kl"] = kl.detach().sum() / valid.sum().clamp(min=1)
        return loss, metrics

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PolicyObjective) and plain_class(self) is plain_class(other)
                and self.settings() == other.settings())

    __hash__ = None  # type: ignore[assignment]


def check_non_negative(**settings: Optional[float]) -> None:
    """A ``ValueError`` naming the first setting below 0 (``None``: unset, left to a default)."""
    for key, value in settings.items():
        if value is not None and not value >= 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")


def plain_class(objective: PolicyObjective) -> type[PolicyObjective]:
    """The objective's own class (not the config parser's lazy-instance wrapper around it)."""
    return next(cls for cls in type(objective).__mro__ if not cls.__name__.startswith(("LazyInstance_", "_LazyInit")))


def log1p_bounds(clip_low: float, clip_high: float) -> tuple[float, float]:
    """A ratio range ``[1 - clip_low, 1 + clip_high]`` in log space (no lower bound past 1)."""
    return math.log1p(clip_high), math.log1p(-clip_low) if clip_low < 1 else -math.inf


__all__ = ["Bound", "MAX_LOG_RATIO", "PolicyObjective", "Units", "check_non_negative", "log1p_bounds", "plain_class"]
