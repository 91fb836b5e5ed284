"""The GSPO policy objective as pure tensor functions.

Everything here works on ``(B, T)`` tensors of response tokens: ``B`` responses, ``T``
response positions, ``mask`` marking the real tokens. Nothing here knows about models,
ranks or Lightning, so every formula can be tested against a hand computation.

The formulas are those of ``docs/algorithm.md`` (importance ratio at token, sequence or
sequence-token level; PPO-style clipping with an optional dual clip; an optional KL term
to a reference model; four ways to aggregate token losses into one number).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from gspo_lightning.objective.options import ImportanceSampling, KLEstimator, LossAggMode, check_choice, choices

IMPORTANCE_SAMPLING_LEVELS = choices(ImportanceSampling)
LOSS_AGG_MODES = choices(LossAggMode)
KL_ESTIMATORS = choices(KLEstimator)

# exp() of a log-ratio above this overflows float32 gradients long before it means anything.
MAX_LOG_RATIO = 20.0
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped surrogate loss (to minimize) and its diagnostics.

    Per token: ``obj = min(w A, clip(w, 1 - clip_low, 1 + clip_high) A)``, with
    ``obj = max(obj, dual_clip * A)`` where ``A < 0`` if ``dual_clip`` is set; the token
    loss is ``-obj + kl_coef * KL`` and is aggregated by ``loss_agg_mode``.

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

    Returns:
        ``(loss, metrics)`` where metrics are detached scalars of this batch: clip
        fractions (low/high/total, and dual), ratio mean/min/max, and ``kl`` when a
        reference is given. For sequence levels, clip fractions and ratios count sequences.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (3 is usual) or None, got {dual_clip}")
    check_choice("kl_estimator", kl_estimator, KLEstimator)
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
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    dual_active = torch.zeros_like(valid)
    if dual_clip is not None:
        dual_active = (advantages < 0) & (surrogate < dual_clip * advantages) & valid
        surrogate = torch.where(dual_active, dual_clip * advantages, surrogate)
    token_loss = -surrogate
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
    metrics = _clip_metrics(ratio.detach(), advantages.detach(), valid, dual_active, importance_sampling, clip_low, clip_high)
    if kl is not None:
        metrics["kl"] = kl.detach().sum() / valid.sum().clamp(min=1)
    return loss, metrics


def _clip_metrics(
    ratio: Tensor,
    advantages: Tensor,
    valid: Tensor,
    dual_active: Tensor,
    importance_sampling: str,
    clip_low: float,
    clip_high: float,
) -> dict[str, Tensor]:
    """Where the clip is *active* (its branch sets the gradient to zero), per token, then
    averaged over tokens (``token``) or over sequences (sequence levels)."""
    low = (ratio < 1.0 - clip_low) & (advantages < 0) & valid
    high = (ratio > 1.0 + clip_high) & (advantages > 0) & valid

    if importance_sampling == "token":
        units = valid.sum().clamp(min=1)

        def frac(flags: Tensor) -> Tensor:
            return flags.sum() / units

        ratios = ratio[valid]
    else:
        lengths = valid.sum(-1)
        seq_valid = lengths > 0
        units = seq_valid.sum().clamp(min=1)

        def frac(flags: Tensor) -> Tensor:
            # share of each sequence's tokens that clip (0 or 1 with one advantage per response)
            return masked_sequence_mean(flags, valid).sum() / units

        first = valid.float().argmax(-1)
        ratios = ratio.gather(-1, first[:, None]).squeeze(-1)[seq_valid]

    if ratios.numel() == 0:
        ratios = torch.ones(1, device=ratio.device)
    clip_low_frac, clip_high_frac = frac(low), frac(high)
    return {
        "clip_frac_low": clip_low_frac,
        "clip_frac_high": clip_high_frac,
        "clip_frac": clip_low_frac + clip_high_frac,
        "dual_clip_frac": frac(dual_active),
        "ratio_mean": ratios.float().mean(),
        "ratio_min": ratios.float().min(),
        "ratio_max": ratios.float().max(),
    }
