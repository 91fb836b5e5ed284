"""How rollouts are sampled: the distribution engines draw from (and the trainer scores
under), and the seeds every sample is drawn with.

With top-k / top-p on, a token is drawn from the temperature-scaled logits restricted to
the kept set and renormalized (vLLM's ``processed_logprobs``). The engine reports the
sampled token's log-prob under that distribution and the trainer recomputes it under the
same one, so the importance ratio compares the policy that actually sampled.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def filters_active(logits_width: int, top_k: int, top_p: float) -> bool:
    """Whether top-k / top-p remove anything from a vocabulary of ``logits_width``."""
    return (0 < top_k < logits_width) or top_p < 1.0


@torch.no_grad()
def keep_mask(logits: Tensor, top_k: int, top_p: float) -> Optional[Tensor]:
    """``True`` where a token survives top-k then top-p (transformers' order); ``None``: all do.

    A selection, not a function to differentiate: computed without autograd.
    """
    if not filters_active(logits.shape[-1], top_k, top_p):
        return None
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        keep = logits >= kth  # ties with the k-th logit stay
    if top_p < 1.0:
        masked = logits.masked_fill(~keep, float("-inf"))
        sorted_logits, order = torch.sort(masked, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        keep = keep & ~drop_sorted.scatter(-1, order, drop_sorted)
    return keep


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Logits outside the top-k / nucleus set to -inf."""
    keep = keep_mask(logits, top_k, top_p)
    return logits if keep is None else logits.masked_fill(~keep, float("-inf"))


# -- seeds ------------------------------------------------------------------------------------
# Every sample's seed derives from the run's base seed by one formula, so a run and its resume
# (and a colocated engine and a server) sample alike. Seeds stay below 2**63 - 1: torch's
# generators and vLLM take them whole.
SEED_MODULUS = 2**63 - 1


def mix_seed(seed: int, value: int, multiplier: int) -> int:
    """``(seed * multiplier + value) mod (2**63 - 1)``: a new seed for ``value`` within ``seed``'s stream."""
    return (seed * multiplier + value) % SEED_MODULUS


def step_seed(base: int, step: int, rank: int) -> int:
    """The sampling seed of rollout step ``step`` on rank ``rank`` of a run whose seed is ``base``."""
    return mix_seed(mix_seed(base, step, 1_000_003), rank, 1031)


def server_share_seed(seed: int, k: int) -> int:
    """The seed of the ``k``-th server's share of a step: the step's own for the first (one server
    samples as a colocated engine would), distinct ones for the others."""
    return seed if k == 0 else mix_seed(seed, k, 1_000_003)


def round_seed(seed: int, round_index: int) -> int:
    """The seed of dynamic sampling's extra round ``round_index`` (>= 1) of a step whose seed is
    ``seed``. A hash rather than ``seed + k``: step seeds are spaced evenly, a sum would reuse another step's."""
    return mix_seed(seed, 7919 * round_index, 1_000_033)


__all__ = ["SEED_MODULUS", "filter_logits", "filters_active", "keep_mask", "mix_seed", "round_seed", "server_share_seed",
           "step_seed"]
