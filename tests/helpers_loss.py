"""The parts of the naive loss reference that the loss and objective tests share: the levels
and modes they sweep, the per-token KL in plain floats, the aggregation over responses, and
random float64 batches. Computed independently of the code under test (plain Python loops,
``math.exp``)."""

from __future__ import annotations

import math

import torch

LEVELS = ("token", "seq", "seq-token")
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-sum-token-sum-norm")

DT = torch.float64


def naive_kl(lp: float, ref: float, estimator: str) -> float:
    u = ref - lp
    if estimator == "k1":
        return -u
    if estimator == "k2":
        return u * u / 2.0
    if estimator == "k3":
        return math.exp(u) - u - 1.0
    raise AssertionError(estimator)


def naive_aggregate(per_seq, mode, *, horizon, num_seqs=None, num_tokens=None):
    n = sum(1 for s in per_seq if len(s) > 0) if num_seqs is None else num_seqs
    n_tok = sum(len(s) for s in per_seq) if num_tokens is None else num_tokens
    if mode == "token-mean":
        total = 0.0
        for s in per_seq:
            for _, l in s:
                total += l
        return total / max(n_tok, 1)
    total = 0.0
    for s in per_seq:
        if not s:
            continue
        seq_sum = 0.0
        for _, l in s:
            seq_sum += l
        if mode == "seq-mean-token-sum":
            total += seq_sum
        elif mode == "seq-mean-token-mean":
            total += seq_sum / len(s)
        elif mode in ("seq-mean-token-sum-norm", "seq-sum-token-sum-norm"):
            total += seq_sum / horizon
        else:
            raise AssertionError(mode)
    if mode == "seq-sum-token-sum-norm":  # ROLL's: summed over sequences, never divided by their number
        return total
    return total / max(n, 1)


def make_mask(lengths, T):
    return torch.tensor([[1.0 if t < L else 0.0 for t in range(T)] for L in lengths], dtype=DT)


def random_batch(seed, lengths=(5, 1, 7, 3, 0, 6, 4), T=8, *, spread=0.3, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    mask = make_mask(lengths, T)
    old = -torch.rand(B, T, generator=g, dtype=DT) * 3.0 - 0.1
    lp = old + torch.randn(B, T, generator=g, dtype=DT) * spread
    ref = old + torch.randn(B, T, generator=g, dtype=DT) * 0.2
    if per_token_adv:
        adv = torch.randn(B, T, generator=g, dtype=DT)
    else:
        adv = torch.randn(B, generator=g, dtype=DT)
    return lp, old, ref, adv, mask
