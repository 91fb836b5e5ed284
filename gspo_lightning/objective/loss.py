"""The GSPO policy objective as pure tensor functions.

Everything here works on ``(B, T)`` tensors of response tokens: ``B`` responses, ``T``
response positions, ``mask`` marking the real tokens. Nothing here knows about models,
ranks or Lightning, so every formula can be tested against a hand computation.

The formulas are those of ``docs/algorithm.md`` (importance ratio at token, sequence or
sequence-token level; the per-unit objective, ``policy_loss_type``: PPO-style clipping with an
optional dual clip, SAPO's soft gate, CISPO's clipped stop-gradient weight or GMPO's geometric
mean; an optional KL term to a reference model; five ways to aggregate token losses into one number).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from gspo_lightning.objective.options import (
    DEFAULT_SAPO_TAU, ImportanceSampling, KLEstimator, LossAggMode, PolicyLossType, check_choice, choices,
)

IMPORTANCE_SAMPLING_LEVELS = choices(ImportanceSampling)
LOSS_AGG_MODES = choices(LossAggMode)
KL_ESTIMATORS = choices(KLEstimator)
POLICY_LOSS_TYPES = choices(PolicyLossType)

# exp() of a log-ratio above this overflows float32 gradients long before it means anything.
MAX_LOG_RATIO = 20.0
# SAPO: a unit is "saturated" where the gate passes less than half of the on-policy gradient
SAPO_SATURATED_WEIGHT = 0.5
# k3 = exp(u) - u - 1 explodes for large u; verl and ROLL clamp it to 10 as well (TRL does not).
MAX_KL_VALUE = 10.0

Count = Union[int, float, Tensor, None]


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from sampled-token log-probs.

    With ``u = ref - lp``: ``k1 = -u``, ``k2 = u^2 / 2``, ``k3 = exp(u) - u - 1`` (clamped
    to ``[0, MAX_KL_VALUE]``, it is non-negative in exact arithmetic).
    """
    u = ref_logprobs - logprobs
    if estimator == "k1":
        return -u
    if estimator == "k2":
        return 0.5 * u.square()
    if estimator == "k3":
        u = u.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return (torch.exp(u) - u - 1.0).clamp(0.0, MAX_KL_VALUE)
    check_choice("kl_estimator", estimator, KLEstimator)
    raise AssertionError("unreachable")


def _as_count(value: Count, fallback: Tensor) -> Tensor:
    """A denominator as a float tensor (at least 1, so an empty batch gives 0, not NaN)."""
    if value is None:
        value = fallback
    if not torch.is_tensor(value):
        value = torch.tensor(float(value), device=fallback.device)
    return value.to(torch.float32).clamp(min=1.0)


def aggregate_loss(
    token_loss: Tensor,
    mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    *,
    num_seqs: Count = None,
    num_tokens: Count = None,
    horizon: Optional[int] = None,
) -> Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar.

    ``num_seqs`` / ``num_tokens`` are the denominators of the *whole* optimizer step (all
    micro-batches, all ranks). Passing them makes the sum of micro-batch losses equal the
    loss of the whole batch; left ``None`` they are this batch's own counts.
    Responses with no valid token contribute nothing and are not counted.
    """
    valid = mask.bool()
    # where() rather than a product: 0 * NaN is NaN, and masked positions may hold garbage.
    token_loss = torch.where(valid, token_loss, torch.zeros_like(token_loss))
    lengths = valid.sum(-1)
    if loss_agg_mode == "token-mean":
        return token_loss.sum() / _as_count(num_tokens, lengths.sum())
    n = _as_count(num_seqs, (lengths > 0).sum())
    seq_sums = token_loss.sum(-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.sum() / n
    if loss_agg_mode == "seq-mean-token-mean":
        return (seq_sums / lengths.clamp(min=1)).sum() / n
    if loss_agg_mode in ("seq-mean-token-sum-norm", "seq-sum-token-sum-norm"):
        h = float(horizon if horizon is not None else mask.shape[-1])
        # ROLL's (and early verl's) variant sums over sequences: its scale grows with the batch
        return seq_sums.sum() / h / (n if loss_agg_mode == "seq-mean-token-sum-norm" else 1.0)
    check_choice("loss_agg_mode", loss_agg_mode, LossAggMode)
    raise AssertionError("unreachable")


def masked_sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``(B,)``: each row's mean of ``values`` over its valid positions (0 for a row with none).

    GSPO's length normalization: the sequence log-ratio ``s_i = (1/|y_i|) sum_t log r_{i,t}``
    is this mean of the token log-ratios. Masked positions may hold anything, NaN included.
    """
    valid = mask.bool()
    return torch.where(valid, values, torch.zeros_like(values)).sum(-1) / valid.sum(-1).clamp(min=1)


def log_importance_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, importance_sampling: str) -> Tensor:
    """``(B, T)`` log importance weights at the requested level (zero at masked positions).

    ``seq`` is the length-normalized (geometric mean) sequence ratio of the GSPO paper, the
    same value on every token; ``seq-token`` has that value but lets each token's gradient
    flow through its own log-prob.
    """
    valid = mask.bool()
    zeros = torch.zeros_like(logprobs)
    logprobs = torch.where(valid, logprobs, zeros)
    delta = torch.where(valid, logprobs - torch.where(valid, old_logprobs, zeros), zeros)
    if importance_sampling == "token":
        return delta
    seq_log_ratio = masked_sequence_mean(delta, valid)[:, None]
    if importance_sampling == "seq":
        return torch.where(valid, seq_log_ratio.expand_as(delta), zeros)
    if importance_sampling == "seq-token":
        return torch.where(valid, seq_log_ratio.detach() + logprobs - logprobs.detach(), zeros)
    check_choice("importance_sampling", importance_sampling, ImportanceSampling)
    raise AssertionError("unreachable")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    importance_sampling: str = "seq",
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: Optional[float] = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    ref_logprobs: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    num_seqs: Count = None,
    num_tokens: Count = None,
    horizon: Optional[int] = None,
    is_weights: Optional[Tensor] = None,
    policy_loss_type: str = "ppo",
    sapo_tau_pos: float = DEFAULT_SAPO_TAU[0],
    sapo_tau_neg: float = DEFAULT_SAPO_TAU[1],
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss (to minimize) and its diagnostics.

    Per unit (a token, or a response at the sequence levels, whose ratio ``w`` is on each of its
    tokens), by ``policy_loss_type`` (``docs/algorithm.md``):

    - ``ppo``: ``-min(w A, clip(w, 1 - clip_low, 1 + clip_high) A)``, with the objective raised
      to ``dual_clip * A`` where ``A < 0`` if ``dual_clip`` is set;
    - ``sapo``: ``-f(w) A`` with ``f(w) = sigmoid(tau (w - 1)) * 4 / tau``, ``tau = sapo_tau_pos``
      where ``A > 0`` else ``sapo_tau_neg``: a soft gate in place of the clip;
    - ``cispo``: ``-sg(clip(w, max(0, 1 - clip_low), 1 + clip_high)) A lp``: the clipped weight
      carries no gradient, so the clip bounds each token's weight and zeroes none;
    - ``gmpo`` (``importance_sampling="seq"`` only): ``-A_i exp((1/L_i) sum_t d'_t)``, each
      token log-ratio ``d_t`` clipped to ``[-clip_low, clip_high]`` on the side the sign of the
      sequence advantage ``A_i`` (the mean of its tokens' advantages) makes binding.

    Each token's loss, plus ``kl_coef * KL``, is aggregated by ``loss_agg_mode``.

    Args:
        logprobs: ``(B, T)`` log-probs of the sampled tokens under the current policy.
        old_logprobs: ``(B, T)`` the same under the policy that generated the samples.
        advantages: ``(B,)`` one per response, or ``(B, T)`` one per token.
        mask: ``(B, T)`` 1 for real response tokens, 0 for padding.
        importance_sampling: ``"token"`` (GRPO/PPO), ``"seq"`` (GSPO) or ``"seq-token"`` (GSPO-token).
        clip_low, clip_high: clip range ``[1 - clip_low, 1 + clip_high]``. Sequence ratios
            need ranges of about 1e-4 (the paper: 3e-4 / 4e-4), token ratios about 0.2.
        dual_clip: ``c > 1`` bounds the loss of negative-advantage samples by ``c * |A|``.
        ref_logprobs, kl_coef, kl_estimator: the KL-to-reference term, when ``kl_coef > 0``.
        num_seqs, num_tokens, horizon: global denominators, see :func:`aggregate_loss`.
        is_weights: ``(B,)`` or ``(B, T)`` off-policy importance weights (``objective/offpolicy.py``,
            no gradient) multiplying each token's surrogate (not the KL term); ``None``: 1.
        policy_loss_type: ``"ppo"`` (default), ``"sapo"``, ``"cispo"`` or ``"gmpo"``, see above.
        sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures (> 0; the paper: 1.0 and 1.05).

    Returns:
        ``(loss, metrics)`` where metrics are detached scalars of this batch: the ratio's
        mean/min/max, ``kl`` when a reference is given, and the objective's own: clip fractions
        (low/high/total; ``dual_clip_frac`` for ppo) for ppo, cispo and gmpo, the gate's
        ``gate_weight_mean`` and ``gate_saturated_frac`` (low/high/total) for sapo. At the
        sequence levels they count sequences (a sequence's share of flagged tokens, for gmpo).
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (3 is usual) or None, got {dual_clip}")
    check_choice("kl_estimator", kl_estimator, KLEstimator)
    check_choice("policy_loss_type", policy_loss_type, PolicyLossType)
    if policy_loss_type == "sapo" and not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise ValueError(f"sapo_tau_pos and sapo_tau_neg must be > 0 (the paper: 1.0, 1.05), got {sapo_tau_pos}, {sapo_tau_neg}")
    if dual_clip is not None and policy_loss_type != "ppo":
        raise ValueError(f"dual_clip bounds PPO's clipped surrogate; policy_loss_type={policy_loss_type!r} has none: pass dual_clip=None")
    if policy_loss_type == "gmpo" and importance_sampling != "seq":
        raise ValueError(f"gmpo's ratio is the geometric mean of the clipped token ratios, a sequence ratio: "
                         f"pass importance_sampling='seq' (got {importance_sampling!r})")
    if mask.dim() != 2 or logprobs.shape != mask.shape or old_logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must all be (B, T)"
        )
    if tuple(advantages.shape) not in (tuple(mask.shape[:1]), tuple(mask.shape)):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be (B,) = {tuple(mask.shape[:1])} or (B, T) = {tuple(mask.shape)}")
    if ref_logprobs is not None and ref_logprobs.shape != mask.shape:
        raise ValueError(f"ref_logprobs {tuple(ref_logprobs.shape)} must be (B, T) = {tuple(mask.shape)}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef is set but ref_logprobs is None: pass the reference log-probs or set kl_coef=0")
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
    units = Units(valid, importance_sampling)
    settings = ObjectiveSettings(clip_low, clip_high, dual_clip, sapo_tau_pos, sapo_tau_neg)
    token_loss, metrics = OBJECTIVES[policy_loss_type](logprobs, old_logprobs, log_ratio, advantages, units, settings)
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


@dataclass(frozen=True)
class ObjectiveSettings:
    """The knobs of the per-unit objectives (see :func:`policy_loss`)."""

    clip_low: float
    clip_high: float
    dual_clip: Optional[float]
    sapo_tau_pos: float
    sapo_tau_neg: float


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


def _fractions(units: Units, low: Tensor, high: Tensor, prefix: str = "clip_frac") -> dict[str, Tensor]:
    low_frac, high_frac = units.mean(low & units.valid), units.mean(high & units.valid)
    return {prefix: low_frac + high_frac, f"{prefix}_low": low_frac, f"{prefix}_high": high_frac}


ObjectiveFn = Callable[[Tensor, Tensor, Tensor, Tensor, Units, ObjectiveSettings], tuple[Tensor, dict[str, Tensor]]]


def ppo_objective(logprobs: Tensor, old_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, units: Units,
                  s: ObjectiveSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """``-min(w A, clip(w) A)`` (and the dual clip). Its clip is *active* where it sets the
    gradient to zero: above ``1 + clip_high`` with ``A > 0``, below ``1 - clip_low`` with ``A < 0``."""
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
    clipped_ratio = ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    dual_active = torch.zeros_like(units.valid)
    if s.dual_clip is not None:
        dual_active = (advantages < 0) & (surrogate < s.dual_clip * advantages) & units.valid
        surrogate = torch.where(dual_active, s.dual_clip * advantages, surrogate)
    ratio, advantages = ratio.detach(), advantages.detach()
    metrics = _fractions(units, (ratio < 1.0 - s.clip_low) & (advantages < 0), (ratio > 1.0 + s.clip_high) & (advantages > 0))
    return -surrogate, {**metrics, "dual_clip_frac": units.mean(dual_active), **units.ratio_stats(ratio)}


def sapo_objective(logprobs: Tensor, old_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, units: Units,
                   s: ObjectiveSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """``-sigmoid(tau (w - 1)) * 4 / tau * A``. Its gradient is the policy gradient ``w A grad log w``
    times ``4 g (1 - g)`` (``g`` the sigmoid): 1 on-policy, decaying smoothly as ``w`` leaves 1,
    on both sides and whatever the sign of ``A``. ``gate_weight_mean`` is that factor's mean,
    ``gate_saturated_frac`` the share of units where it is below :data:`SAPO_SATURATED_WEIGHT`."""
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    taus = [torch.tensor(t, dtype=ratio.dtype, device=ratio.device) for t in (s.sapo_tau_pos, s.sapo_tau_neg)]
    tau = torch.where(advantages > 0, *taus)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    token_loss = -(gate * 4.0 / tau) * advantages
    gate, ratio = gate.detach(), ratio.detach()
    weight = 4.0 * gate * (1.0 - gate)
    saturated = weight < SAPO_SATURATED_WEIGHT
    metrics = _fractions(units, saturated & (ratio < 1.0), saturated & (ratio > 1.0), prefix="gate_saturated_frac")
    return token_loss, {**metrics, "gate_weight_mean": units.mean(weight), **units.ratio_stats(ratio)}


def cispo_objective(logprobs: Tensor, old_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, units: Units,
                    s: ObjectiveSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """``-sg(clip(w, max(0, 1 - clip_low), 1 + clip_high)) A lp``: the REINFORCE gradient
    ``A grad lp`` weighted by the bounded ratio. A unit is *clipped* where its weight was
    bounded, whatever the sign of ``A`` (its gradient still flows)."""
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO)).detach()
    weight = ratio.clamp(max(0.0, 1.0 - s.clip_low), 1.0 + s.clip_high)
    metrics = _fractions(units, ratio < 1.0 - s.clip_low, ratio > 1.0 + s.clip_high)
    return -weight * advantages * logprobs, {**metrics, **units.ratio_stats(ratio)}


def gmpo_objective(logprobs: Tensor, old_logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, units: Units,
                   s: ObjectiveSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """``-A_i exp(mean_t d'_t)`` on every token of response ``i``, ``d'`` the token log-ratios
    clipped above ``clip_high`` where ``A_i > 0`` and below ``-clip_low`` where ``A_i < 0``
    (``sign(A) min(sign(A) d, sign(A) clamp(d))``): a clipped token adds no gradient, the others
    ``A_i w_i / L_i``. The ratio metrics are of the unclipped geometric mean (GSPO's ``s_i``)."""
    valid = units.valid
    zeros = torch.zeros_like(logprobs)
    seq_adv = masked_sequence_mean(advantages, valid)[:, None]
    sign = torch.sign(seq_adv)
    delta = torch.where(valid, logprobs - old_logprobs, zeros)
    clipped = sign * torch.minimum(sign * delta, sign * delta.clamp(-s.clip_low, s.clip_high))
    log_weight = masked_sequence_mean(clipped, valid)[:, None].clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    token_loss = torch.where(valid, -seq_adv * torch.exp(log_weight), zeros)
    delta, seq_adv = delta.detach(), seq_adv.detach()
    metrics = _fractions(units, (delta < -s.clip_low) & (seq_adv < 0), (delta > s.clip_high) & (seq_adv > 0))
    ratio = torch.exp(log_ratio.detach().clamp(max=MAX_LOG_RATIO))
    return token_loss, {**metrics, **units.ratio_stats(ratio)}


# policy_loss_type -> its per-unit objective
OBJECTIVES: dict[str, ObjectiveFn] = {
    "ppo": ppo_objective, "sapo": sapo_objective, "cispo": cispo_objective, "gmpo": gmpo_objective,
}
