"""The clip budget, explained: which part of the log-ratio made the clip act.

The ratio the loss clips is ``lp - old``. Against the engine's log-probs ``b`` it splits,
per token, into three parts (``o_b``: the trainer's log-prob at the weights that sampled,
``o``: the trainer's at the start of this update, ``lp``: the policy being updated)::

    lp - b  =  (o_b - b)   +   (o - o_b)   +   (lp - o)
               numerics        staleness       update

- **numerics**: engine vs trainer on the same weights (precision, kernels, batch shapes);
- **staleness**: the updates made between generation and this update (0 when synchronous);
- **update**: this rollout's own optimizer steps, the only part the clip is meant to bound.

Which parts the clip sees depends on what ``old`` is: with ``old = b`` (``old_logprobs:
engine``, bypass) all three; with ``old = o`` (recompute, decoupled) only the update (the
other two are then in the off-policy weight, ``objective/offpolicy.py``).

Attribution, per unit (a token for ``importance_sampling: token``, a response for the
sequence levels, whose parts are the length-normalized means of the token parts, as the
GSPO ratio is): a unit is *clipped* when the clip is active, as ``loss/clip_frac`` counts
it (ratio above ``1 + clip_high`` with a positive advantage, or below ``1 - clip_low`` with a
negative one). A clipped unit's **cause** is the part, among those the clip sees, that
pushes furthest in the direction of the violation (the largest part above the range, the
most negative below it); ties go to numerics, then staleness, then update. Causes
partition the clipped units, so ``clip_budget/numerics + staleness + update`` equals the
clip fraction. Separately, ``clip_budget/<part>_alone`` counts the units whose part *alone*
is outside the range on the side that clipped: numerics alone clipping means the range is
narrower than the engine's precision.

``behaviour`` (numerics and staleness together, the part an off-policy weight corrects) is
always reported too. When ``o_b`` is unknown (a stale rollout whose producer kept no trainer
log-probs), numerics and staleness cannot be told apart: they are NaN, ``behaviour`` is not.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from gspo_lightning.objective.loss import masked_sequence_mean

PARTS = ("numerics", "staleness", "update")


def split_log_ratio(logprobs: Tensor, old: Tensor, behaviour: Tensor, behaviour_old: Optional[Tensor]) -> dict[str, Tensor]:
    """Per-token parts of ``lp - b``: ``numerics``, ``staleness``, ``update`` (or
    ``behaviour`` and ``update`` when ``behaviour_old`` (``o_b``) is ``None``)."""
    if behaviour_old is None:
        return {"behaviour": old - behaviour, "update": logprobs - old}
    return {"numerics": behaviour_old - behaviour, "staleness": old - behaviour_old, "update": logprobs - old}


def attribute_clips(
    parts: dict[str, Tensor],
    in_clip: tuple[str, ...],
    mask: Tensor,
    advantages: Tensor,
    *,
    level: str,
    clip_low: float,
    clip_high: float,
) -> dict[str, Tensor]:
    """Counts over units: ``units``, ``clipped``, ``<part>`` (clipped, caused by the part)
    and ``<part>_alone`` (the part alone outside the range on the clipped side), for the parts
    named in ``in_clip`` (the others are outside the ratio and cannot clip).

    ``parts`` are ``(B, T)`` per-token log-ratio parts; ``advantages`` ``(B,)`` or ``(B, T)``.
    """
    valid = mask.bool()
    zeros = torch.zeros_like(mask, dtype=torch.float32)
    tokens = {name: torch.where(valid, parts[name].float(), zeros) for name in in_clip}
    adv = advantages.float() if advantages.dim() == 2 else advantages.float()[:, None].expand_as(zeros)
    adv = torch.where(valid, adv, zeros)
    if level == "token":
        units = valid
        values = tokens
        unit_adv = adv
    else:  # a response's part is the mean of its token parts, as the sequence log-ratio is
        units = valid.any(-1)
        values = {name: masked_sequence_mean(value, valid) for name, value in tokens.items()}
        unit_adv = masked_sequence_mean(adv, valid)
    stacked = torch.stack([values[name] for name in in_clip])  # (parts, units...)
    total = stacked.sum(0)
    upper, lower = math.log1p(clip_high), math.log1p(-clip_low)
    high = (total > upper) & (unit_adv > 0) & units
    low = (total < lower) & (unit_adv < 0) & units
    # the part pushing furthest towards the violated bound (argmax keeps the first of ties)
    cause = torch.where(high, stacked.argmax(0), stacked.argmin(0))
    out = {"units": units.sum().float(), "clipped": (high | low).sum().float()}
    for index, name in enumerate(in_clip):
        value = values[name]
        out[name] = ((high | low) & (cause == index)).sum().float()
        out[f"{name}_alone"] = ((high & (value > upper)) | (low & (value < lower))).sum().float()
    return out


def clip_budget_metrics(counts: dict[str, Tensor], all_parts: tuple[str, ...]) -> dict[str, tuple[Tensor, Tensor]]:
    """``{metric: (fraction, weight)}`` for ``StepMetrics``: every part is reported (0 for
    those outside the clip), each as a fraction of the units, weighted by the unit count."""
    units = counts["units"]
    denominator = units.clamp(min=1)
    out = {"clip_budget/clip_frac": (counts["clipped"] / denominator, units)}
    for name in all_parts:
        for key in (name, f"{name}_alone"):
            value = counts.get(key, torch.zeros(()))
            out[f"clip_budget/{key}"] = (value / denominator, units)
    return out


class ClipBudget:
    """A metric hook (``training/update.py``'s ``metric_hooks``) attributing each micro-batch's clips.

    Before each rollout's updates, :meth:`begin` receives the rollout's tensors: ``old``
    (the trainer's recomputed log-probs at this update's start, ``o``), ``behaviour`` (the
    engine's, ``b``), ``behaviour_old`` (the trainer's at the sampling weights, ``o_b``, or
    ``None``) and whether the clip's old policy is the engine's (``old_is_behaviour``).
    ``old`` may be ``None`` when the first forward is the old policy (one update per
    rollout): the micro-batch's own old log-probs are then ``o``.
    """

    def __init__(self, level: str, clip_low: float, clip_high: float):
        self.level, self.clip_low, self.clip_high = level, clip_low, clip_high
        self.old = self.behaviour = self.behaviour_old = None
        self.old_is_behaviour = self.same_weights = False
        self.active = False

    def begin(self, *, old: Optional[Tensor], behaviour: Tensor, behaviour_old: Optional[Tensor], old_is_behaviour: bool,
              same_weights: bool = False) -> None:
        """``same_weights``: the rollout was sampled with the weights being updated (no
        staleness), so ``o_b = o`` whatever ``behaviour_old`` says."""
        self.old, self.behaviour, self.behaviour_old = old, behaviour, behaviour_old
        self.old_is_behaviour, self.same_weights = old_is_behaviour, same_weights
        self.active = not (old_is_behaviour and old is None)  # bypass without o: nothing to split

    def __call__(self, micro) -> dict[str, tuple[Tensor, Tensor]]:
        if not self.active:
            return {}
        rows = micro.rows
        old = self.old[rows] if self.old is not None else micro.old_logprobs
        behaviour_old = old if self.same_weights else self.behaviour_old[rows] if self.behaviour_old is not None else None
        def counts(parts: dict[str, Tensor]) -> dict[str, Tensor]:
            in_clip = tuple(parts) if self.old_is_behaviour else ("update",)
            return attribute_clips(parts, in_clip, micro.mask, micro.advantages, level=self.level,
                                   clip_low=self.clip_low, clip_high=self.clip_high)

        # every step logs the same names (a logger repeats a name's last value on steps that
        # lack it): behaviour = numerics and staleness together, always; the two apart, or NaN
        merged = counts(split_log_ratio(micro.logprobs, old, self.behaviour[rows], None))
        out = clip_budget_metrics(merged, ("behaviour", "update"))
        if behaviour_old is not None:
            out.update(clip_budget_metrics(counts(split_log_ratio(micro.logprobs, old, self.behaviour[rows], behaviour_old)), PARTS))
        else:
            unknown = torch.tensor(float("nan"))
            for name in ("numerics", "staleness"):
                out[f"clip_budget/{name}"] = out[f"clip_budget/{name}_alone"] = (unknown, merged["units"])
        return out


__all__ = ["ClipBudget", "PARTS", "attribute_clips", "clip_budget_metrics", "split_log_ratio"]
