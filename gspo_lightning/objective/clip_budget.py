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

The other objectives (``objective.policy_loss``: ``sapo.py``, ``cispo.py``, ``gmpo.py``) are split the
same way, each unit flagged as its objective flags it in ``loss/`` (the objective's ``log_bounds``,
``trust_region`` and ``token_flags`` say how): ``cispo``, a unit whose weight was bounded
(beyond either bound, whatever the sign of the advantage); ``gmpo``, each *token* whose
log-ratio is beyond ``clip_high`` (positive advantage) or ``-clip_low`` (negative), a response
counting its share of such tokens; ``sapo``, a unit whose gate passes less than half of the
gradient (``|tau (w - 1)| > 1.763``, ``tau`` by the sign of the advantage, either side).

``behaviour`` (numerics and staleness together, the part an off-policy weight corrects) is
always reported too. When ``o_b`` is unknown (a stale rollout whose producer kept no trainer
log-probs), numerics and staleness cannot be told apart: they are NaN, ``behaviour`` is not.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from gspo_lightning.objective.policy import PolicyObjective
from gspo_lightning.objective.terms import masked_sequence_mean

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
    objective: PolicyObjective,
) -> dict[str, Tensor]:
    """Counts over units: ``units``, ``clipped``, ``<part>`` (clipped, caused by the part)
    and ``<part>_alone`` (the part alone outside the range on the clipped side), for the parts
    named in ``in_clip`` (the others are outside the ratio and cannot clip). ``objective`` (resolved:
    its clip range filled in) gives the bounds; with ``token_flags`` (gmpo) the flags are per token
    and a response adds its share of flagged tokens.

    ``parts`` are ``(B, T)`` per-token log-ratio parts; ``advantages`` ``(B,)`` or ``(B, T)``.
    """
    valid = mask.bool()
    zeros = torch.zeros_like(mask, dtype=torch.float32)
    tokens = {name: torch.where(valid, parts[name].float(), zeros) for name in in_clip}
    adv = advantages.float() if advantages.dim() == 2 else advantages.float()[:, None].expand_as(zeros)
    adv = torch.where(valid, adv, zeros)
    # where: the entries flags live on (tokens or responses); weight: what a flag adds to the counts
    if level == "token":
        units = where = valid
        weight = valid.float()
        values, unit_adv = tokens, adv
    elif objective.token_flags:  # token flags, a response adding its share of them
        units, where = valid.any(-1), valid
        weight = torch.where(valid, 1.0 / valid.sum(-1, keepdim=True).clamp(min=1), zeros)
        values, unit_adv = tokens, masked_sequence_mean(adv, valid)[:, None].expand_as(zeros)
    else:  # a response's part is the mean of its token parts, as the sequence log-ratio is
        units = where = valid.any(-1)
        weight = units.float()
        values = {name: masked_sequence_mean(value, valid) for name, value in tokens.items()}
        unit_adv = masked_sequence_mean(adv, valid)
    stacked = torch.stack([values[name] for name in in_clip])  # (parts, units...)
    total = stacked.sum(0)
    upper, lower = objective.log_bounds(unit_adv)
    high = (total > upper) & where
    low = (total < lower) & where
    if objective.trust_region:  # a trust region: only the side the advantage pushes towards
        high, low = high & (unit_adv > 0), low & (unit_adv < 0)
    # the part pushing furthest towards the violated bound (argmax keeps the first of ties)
    cause = torch.where(high, stacked.argmax(0), stacked.argmin(0))
    count = lambda flags: (flags.float() * weight).sum()  # noqa: E731
    out = {"units": units.sum().float(), "clipped": count(high | low)}
    for index, name in enumerate(in_clip):
        value = values[name]
        out[name] = count((high | low) & (cause == index))
        out[f"{name}_alone"] = count((high & (value > upper)) | (low & (value < lower)))
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

    def __init__(self, level: str, objective: PolicyObjective):
        self.level, self.objective = level, objective.resolved(level)
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
            return attribute_clips(parts, in_clip, micro.mask, micro.advantages, level=self.level, objective=self.objective)

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
