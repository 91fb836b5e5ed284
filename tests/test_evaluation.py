"""Tests for gspo_lightning.objective.passk (pass@k)."""

from __future__ import annotations

import itertools
from math import comb

import pytest

from gspo_lightning.objective.passk import pass_at_k, pass_at_k_from_scores


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) holding at least one correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 0.4),
        (5, 2, 2, 0.7),
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),
        (5, 5, 1, 1.0),
        (5, 5, 5, 1.0),
        (5, 4, 2, 1.0),  # n - c < k: every pair holds a correct sample
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (10, 3, 10, 1.0),
    ],
)
def test_pass_at_k_hand_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_equals_brute_force_enumeration():
    for n in range(1, 9):
        for c in range(0, n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k)), (n, c, k)


def test_pass_at_k_equals_binomial_formula_for_large_n():
    # the product form stays accurate where the binomials are huge
    for n, c, k in [(200, 13, 10), (1000, 1, 100), (500, 250, 50)]:
        exact = 1 - comb(n - c, k) / comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize(
    "n, c, k",
    [(3, 1, 4), (3, 4, 1), (-1, 0, 1), (5, -1, 1), (5, 1, -1), (5, 1, 0), (5.0, 1, 1), (5, 1, True)],
)
def test_pass_at_k_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_at_k_from_scores():
    scores = [
        [1.0, 0.0, 1.0, 0.0, 0.0],  # n=5, c=2
        [0.0, 0.0, 0.0, 0.0, 0.0],  # c=0
        [1.0, 1.0, 1.0, 1.0, 1.0],  # c=5
    ]
    assert pass_at_k_from_scores(scores, k=1) == pytest.approx((0.4 + 0 + 1) / 3)
    assert pass_at_k_from_scores(scores, k=2) == pytest.approx((0.7 + 0 + 1) / 3)


def test_pass_at_k_from_scores_threshold_and_ragged_problems():
    scores = [[0.5, 0.9, 0.2], [0.7, 0.1]]
    # threshold 0.5: problem 0 has c=2 of 3, problem 1 has c=1 of 2
    assert pass_at_k_from_scores(scores, k=1, threshold=0.5) == pytest.approx((2 / 3 + 1 / 2) / 2)
    # default threshold 1.0: nothing counts as correct
    assert pass_at_k_from_scores(scores, k=1) == 0.0


def test_pass_at_k_from_scores_errors():
    with pytest.raises(ValueError, match="empty"):
        pass_at_k_from_scores([], k=1)
    with pytest.raises(ValueError, match="problem 1 has 1 samples, fewer than k=2"):
        pass_at_k_from_scores([[1.0, 0.0], [1.0]], k=2)
    with pytest.raises(ValueError):
        pass_at_k_from_scores([[1.0]], k=0)
