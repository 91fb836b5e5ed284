"""The terms every policy objective shares, as pure tensor functions: the importance ratio at each
level, GSPO's length normalization, the KL estimators and the aggregation of token losses.

Everything here works on ``(B, T)`` tensors of response tokens: ``B`` responses, ``T``
response positions, ``mask`` marking the real tokens (``docs/algorithm.md``).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from gspo_lightning.objective.options import ImportanceSampling, KLEstimator, LossAggMode, check_choice

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


__all__ = ["Count", "MAX_KL_VALUE", "MAX_LOG_RATIO", "aggregate_loss", "kl_penalty", "log_importance_ratio", "masked_sequence_mean"]
