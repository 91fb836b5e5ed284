"""Which responses and tokens an update trains on.

- **Overlong filtering** (DAPO): a response cut off at ``response_length`` has no ending
  to be judged by, so its tokens leave the loss: the loss mask drops the row. The loss's
  denominators come from the same mask (``training/update.py`` counts sequences with a token left
  and tokens left), so every ``loss_agg_mode`` averages over the responses that remain.
- **Skipping zero-advantage rows**: with no KL term (and no MoE load-balancing loss), a
  response whose advantage is zero at every token adds exactly zero to the loss and to
  every gradient. Its forward and backward can be skipped while the denominators stay
  those of the whole mini-batch, so loss and gradient are unchanged. One row per
  mini-batch always runs (Adam with an all-zero gradient still steps on its momentum, with
  no gradient it would not), and on several ranks one row per micro-batch (every rank must
  run as many backward passes).
"""

from __future__ import annotations

from torch import Tensor


def loss_mask(response_mask: Tensor, truncated: Tensor, overlong_filtering: bool) -> Tensor:
    """``(N, R)`` tokens that enter the loss; with ``overlong_filtering`` none of a truncated response."""
    if not overlong_filtering:
        return response_mask
    return response_mask & ~truncated.bool()[:, None]


def rows_with_advantage(advantages: Tensor, mask: Tensor) -> Tensor:
    """``(N,)`` True where a response has a non-zero advantage at some token of ``mask``
    (``advantages``: ``(N,)`` per response or ``(N, R)`` per token)."""
    valid = mask.bool()
    if advantages.dim() == 1:
        return (advantages != 0) & valid.any(-1)
    return ((advantages != 0) & valid).any(-1)


def micro_batches(mini_rows: Tensor, micro_batch_size: int, teaching=None, *, same_count: bool = False) -> list[Tensor]:
    """The micro-batches of one mini-batch (``mini_rows``: row indices).

    ``teaching`` (``(N,)`` bool, or ``None``: no skipping) drops rows that teach nothing.
    With ``same_count`` (several ranks) the split comes first and an emptied micro-batch keeps
    its first row, so the number of micro-batches never changes; otherwise the rows that
    teach are packed into as few micro-batches as fit, and a mini-batch where none teaches
    keeps its first row.
    """
    if teaching is None:
        return list(mini_rows.split(micro_batch_size))
    if same_count:
        return [rows[teaching[rows]] if bool(teaching[rows].any()) else rows[:1] for rows in mini_rows.split(micro_batch_size)]
    kept = mini_rows[teaching[mini_rows]]
    return list(kept.split(micro_batch_size)) if kept.numel() else [mini_rows[:1]]


__all__ = ["loss_mask", "micro_batches", "rows_with_advantage"]
