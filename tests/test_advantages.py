"""Unit tests of ``gspo_lightning.objective.advantages`` (docs: GSPO.md section 1).

Expected values come from hand computations or from the naive loop references below
(plain Python lists, the ``statistics`` module for unbiased std), never from the code under
test. Conventions checked: std is unbiased (n - 1), ``eps`` is added to the std (not the
variance), responses of one group are contiguous rows.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import statistics

import pytest
import torch
from torch.testing import assert_close

from gspo_lightning.objective.advantages import (
    RunningMoments,
    clip_advantages,
    clip_rewards,
    compute_advantages,
    group_mean_std,
    moments,
    normalize_rewards,
    rewards_to_advantages,
    token_level_rewards,
    whiten,
)

DT = torch.float64


# --------------------------------------------------------------------------------------
# naive references
# --------------------------------------------------------------------------------------


def n_mean(xs):
    return sum(xs) / len(xs)


def n_std(xs):
    """Unbiased std, 0 for fewer than two values."""
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def n_normalize(r, G, norm, *, shift=False, scale=False, eps=1e-6, history=None):
    """Naive step 2. ``history``: every reward seen before this batch (for ``running``)."""
    if norm is None:
        return list(r)
    out = []
    for i, x in enumerate(r):
        if norm == "group":
            g = i // G
            pool = r[g * G:(g + 1) * G]
        elif norm == "batch":
            pool = r
        else:
            pool = list(history) + list(r)
        m, s = n_mean(pool), n_std(pool)
        if shift:
            out.append(x - m)
        elif scale:
            out.append(x / (s + eps))
        else:
            out.append((x - m) / (s + eps))
    return out


def n_kl(old, ref, est):
    u = ref - old
    return {"k1": -u, "k2": u * u / 2, "k3": math.exp(u) - u - 1}[est]


def n_token_rewards(scores, mask, old=None, ref=None, kl_coef=0.0, est="k1"):
    B, T = len(mask), len(mask[0])
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        valid_t = [t for t in range(T) if mask[i][t]]
        if valid_t:
            out[i][valid_t[-1]] += scores[i]
        if ref is not None and kl_coef != 0.0:
            for t in valid_t:
                out[i][t] -= kl_coef * n_kl(old[i][t], ref[i][t], est)
    return out


def n_advantages(tok, mask, G, est, eps=1e-6):
    B, T = len(mask), len(mask[0])
    out = [[0.0] * T for _ in range(B)]
    if est == "reinforce":
        for i in range(B):
            acc = 0.0
            for t in reversed(range(T)):
                if mask[i][t]:
                    acc += tok[i][t]
                    out[i][t] = acc
        return out
    R = [sum(tok[i][t] for t in range(T) if mask[i][t]) for i in range(B)]
    for i in range(B):
        g = i // G
        grp = R[g * G:(g + 1) * G]
        if est == "grpo":
            a = (R[i] - n_mean(grp)) / (n_std(grp) + eps)
        elif est == "rloo":
            others = [R[j] for j in range(g * G, (g + 1) * G) if j != i]
            a = R[i] - n_mean(others)
        elif est == "dr_grpo":
            a = R[i] - n_mean(grp)
        else:
            raise AssertionError(est)
        for t in range(T):
            if mask[i][t]:
                out[i][t] = a
    return out


def n_whiten(vals, mask, eps=1e-6):
    flat = [vals[i][t] for i in range(len(mask)) for t in range(len(mask[0])) if mask[i][t]]
    m, s = n_mean(flat), n_std(flat)
    return [[(vals[i][t] - m) / (s + eps) if mask[i][t] else 0.0 for t in range(len(mask[0]))] for i in range(len(mask))]


def n_clip(x, c):
    return max(-c, min(c, x))


def n_pipeline(scores, mask, G, *, est, norm=None, shift=False, scale=False, reward_clip=None, whiten_adv=False,
               adv_clip=None, eps=1e-6, old=None, ref=None, kl_coef=0.0, kl_est="k1"):
    r = n_normalize(scores, G, norm, shift=shift, scale=scale, eps=eps)
    if reward_clip is not None:
        r = [n_clip(x, reward_clip) for x in r]
    tok = n_token_rewards(r, mask, old, ref, kl_coef, kl_est)
    adv = n_advantages(tok, mask, G, est, eps)
    if whiten_adv:
        adv = n_whiten(adv, mask, eps)
    if adv_clip is not None:
        adv = [[n_clip(a, adv_clip) if mask[i][t] else 0.0 for t, a in enumerate(row)] for i, row in enumerate(adv)]
    return r, adv


def make_mask(lengths, T):
    return torch.tensor([[1.0 if t < L else 0.0 for t in range(T)] for L in lengths], dtype=DT)


def T_(x):
    return torch.tensor(x, dtype=DT)


# --------------------------------------------------------------------------------------
# step 2: reward normalization
# --------------------------------------------------------------------------------------


def test_group_norm_by_hand():
    # group 0: [1, 2, 3] mean 2, unbiased std 1; group 1: identical -> 0; eps = 0.1 (added to std)
    r = T_([1.0, 2.0, 3.0, 4.0, 4.0, 4.0])
    out = normalize_rewards(r, 3, "group", eps=0.1)
    assert_close(out, T_([-1 / 1.1, 0.0, 1 / 1.1, 0.0, 0.0, 0.0]))
    assert_close(normalize_rewards(r, 3, "group", reward_shift=True, eps=0.1), T_([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    assert_close(normalize_rewards(r, 3, "group", reward_scale=True, eps=0.1),
                 T_([1 / 1.1, 2 / 1.1, 3 / 1.1, 4 / 0.1, 4 / 0.1, 4 / 0.1]))


def test_batch_norm_by_hand():
    # [1, 2, 3, 6]: mean 3, unbiased var (4 + 1 + 0 + 9) / 3 = 14/3
    r = T_([1.0, 2.0, 3.0, 6.0])
    s = math.sqrt(14 / 3)
    assert_close(normalize_rewards(r, 2, "batch", eps=0.1), T_([(x - 3) / (s + 0.1) for x in [1, 2, 3, 6]]))
    assert_close(normalize_rewards(r, 2, "batch", reward_shift=True), T_([-2.0, -1.0, 0.0, 3.0]))
    assert_close(normalize_rewards(r, 2, "batch", reward_scale=True, eps=0.1), T_([x / (s + 0.1) for x in [1, 2, 3, 6]]))


@pytest.mark.parametrize("variant", ["plain", "shift", "scale"])
@pytest.mark.parametrize("norm", ["group", "batch"])
def test_group_and_batch_norm_vs_naive(norm, variant):
    g = torch.Generator().manual_seed(0)
    r = (torch.randn(12, generator=g, dtype=DT) * 3 + 1).tolist()
    kw = dict(reward_shift=variant == "shift", reward_scale=variant == "scale")
    out = normalize_rewards(T_(r), 4, norm, eps=0.05, **kw)
    expected = n_normalize(r, 4, norm, shift=kw["reward_shift"], scale=kw["reward_scale"], eps=0.05)
    assert_close(out, T_(expected))


@pytest.mark.parametrize("variant", ["plain", "shift", "scale"])
def test_running_norm_vs_naive(variant):
    g = torch.Generator().manual_seed(1)
    kw = dict(reward_shift=variant == "shift", reward_scale=variant == "scale")
    running = RunningMoments()
    history: list[float] = []
    for size, loc in [(4, 0.0), (6, 5.0), (2, -3.0), (8, 1.0)]:
        r = (torch.randn(size, generator=g, dtype=DT) * 2 + loc).tolist()
        out = normalize_rewards(T_(r), 2, "running", running=running, eps=0.05, **kw)
        # the running state is updated with this batch before it is used
        expected = n_normalize(r, 2, "running", shift=kw["reward_shift"], scale=kw["reward_scale"], eps=0.05,
                               history=history)
        assert_close(out, T_(expected))
        history += r


def test_reward_norm_none_returns_rewards_unchanged():
    r = T_([3.0, -1.0, 7.5, 0.0])
    assert_close(normalize_rewards(r, 2, None), T_([3.0, -1.0, 7.5, 0.0]), rtol=0, atol=0)


@pytest.mark.parametrize("kw", [dict(reward_shift=True), dict(reward_scale=True)])
def test_shift_or_scale_without_reward_norm_raises(kw):
    with pytest.raises(ValueError):
        normalize_rewards(T_([1.0, 2.0]), 2, None, **kw)


def test_unknown_reward_norm_and_running_without_state_raise():
    with pytest.raises(ValueError):
        normalize_rewards(T_([1.0, 2.0]), 2, "global")
    with pytest.raises(ValueError):
        normalize_rewards(T_([1.0, 2.0]), 2, "running", running=None)


@pytest.mark.parametrize("variant", ["plain", "shift", "scale"])
@pytest.mark.parametrize("norm", ["group", "batch", "running"])
def test_identical_rewards_normalize_to_zero_not_nan(norm, variant):
    r = T_([0.7] * 8)
    kw = dict(reward_shift=variant == "shift", reward_scale=variant == "scale")
    out = normalize_rewards(r, 4, norm, running=RunningMoments(), **kw)
    assert torch.isfinite(out).all()
    if variant != "scale":  # scale only divides: 0.7 / eps is finite but not 0
        assert_close(out, torch.zeros(8, dtype=DT), rtol=0, atol=0)


def test_group_norm_with_one_identical_group_among_others():
    r = T_([1.0, 1.0, 1.0, 0.0, 1.0, 5.0])
    out = normalize_rewards(r, 3, "group")
    assert torch.isfinite(out).all()
    assert_close(out[:3], torch.zeros(3, dtype=DT), rtol=0, atol=0)
    assert_close(out[3:], T_(n_normalize([0.0, 1.0, 5.0], 3, "group")))


def test_group_mean_std_and_moments_vs_naive():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(15, generator=g, dtype=DT)
    mean, std = group_mean_std(x, 5)
    xl = x.tolist()
    for i in range(15):
        grp = xl[(i // 5) * 5:(i // 5) * 5 + 5]
        assert math.isclose(mean[i].item(), n_mean(grp), rel_tol=1e-12, abs_tol=1e-12)
        assert math.isclose(std[i].item(), n_std(grp), rel_tol=1e-12)
    with pytest.raises(ValueError):
        group_mean_std(x, 4)  # 15 responses are not whole groups of 4
    vals = torch.randn(3, 4, generator=g, dtype=DT)
    mask = make_mask([4, 0, 2], 4)
    m, s, c = moments(vals.masked_fill(mask == 0, float("nan")), mask)
    flat = [vals[i, t].item() for i in range(3) for t in range(4) if mask[i, t]]
    assert c.item() == 6
    assert math.isclose(m.item(), n_mean(flat), rel_tol=1e-12)
    assert math.isclose(s.item(), n_std(flat), rel_tol=1e-12)


# --------------------------------------------------------------------------------------
# RunningMoments
# --------------------------------------------------------------------------------------


def test_running_moments_equal_concatenation():
    g = torch.Generator().manual_seed(3)
    rm = RunningMoments()
    seen: list[float] = []
    for size, loc, scale in [(5, 0.0, 1.0), (1, 10.0, 1.0), (7, -2.0, 3.0), (3, 100.0, 0.5)]:
        batch = (torch.randn(size, generator=g, dtype=DT) * scale + loc).tolist()
        rm.update(T_(batch))
        seen += batch
        assert rm.count == len(seen)
        assert math.isclose(rm.mean, statistics.fmean(seen), rel_tol=1e-12)
        if len(seen) > 1:
            assert math.isclose(rm.std, statistics.stdev(seen), rel_tol=1e-10)


def test_running_moments_single_value_and_empty_update():
    rm = RunningMoments()
    rm.update(T_([4.0]))
    assert rm.count == 1 and rm.mean == 4.0 and rm.std == 0.0
    rm.update(torch.zeros(0, dtype=DT))
    assert rm.count == 1 and rm.mean == 4.0
    rm.update(T_([6.0]))
    assert math.isclose(rm.mean, 5.0) and math.isclose(rm.std, statistics.stdev([4.0, 6.0]))


def test_running_moments_state_dict_round_trip():
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(n, generator=g, dtype=DT) * 2 + 3 for n in (6, 4, 9, 5)]
    a = RunningMoments()
    for b in batches[:2]:
        a.update(b)
    state = json.loads(json.dumps(a.state_dict()))  # survives a text checkpoint
    b_ = RunningMoments()
    b_.load_state_dict(state)
    assert (b_.count, b_.mean, b_.std) == (a.count, a.mean, a.std)
    for batch in batches[2:]:
        out_a = normalize_rewards(batch, 1, "running", running=a)
        out_b = normalize_rewards(batch, 1, "running", running=b_)
        assert_close(out_a, out_b, rtol=0, atol=0)
    seen = [x for b in batches for x in b.tolist()]
    assert math.isclose(b_.mean, statistics.fmean(seen), rel_tol=1e-12)
    assert math.isclose(b_.std, statistics.stdev(seen), rel_tol=1e-10)
    # a deep copy of the state dict must not alias the live object
    snap = copy.deepcopy(a.state_dict())
    a.update(T_([1000.0]))
    assert snap != a.state_dict()


# --------------------------------------------------------------------------------------
# steps 3 and 7: clips
# --------------------------------------------------------------------------------------


def test_clip_rewards_and_advantages_by_hand():
    x = T_([-15.0, -10.0, -3.0, 0.0, 9.99, 10.0, 42.0])
    assert_close(clip_rewards(x, 10.0), T_([-10.0, -10.0, -3.0, 0.0, 9.99, 10.0, 10.0]))
    assert_close(clip_rewards(x, None), x)
    a = T_([[-3.0, -2.0, 0.5], [2.5, 1.9, 0.0]])
    assert_close(clip_advantages(a, 2.0), T_([[-2.0, -2.0, 0.5], [2.0, 1.9, 0.0]]))
    assert_close(clip_advantages(a, None), a)


# --------------------------------------------------------------------------------------
# step 4: token rewards
# --------------------------------------------------------------------------------------


def test_token_level_rewards_by_hand():
    scores = T_([1.5, -2.0, 7.0, 0.25])
    mask = make_mask([3, 1, 0, 4], 4)
    out = token_level_rewards(scores, mask)
    assert_close(out, T_([
        [0.0, 0.0, 1.5, 0.0],
        [-2.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],  # an empty response gets nothing
        [0.0, 0.0, 0.0, 0.25],
    ]), rtol=0, atol=0)


def test_token_level_rewards_on_last_valid_token_of_a_mask_with_holes():
    # "m = 0 for padding and for anything masked out" (GSPO.md): a response whose mask has a
    # hole (e.g. a masked-out span) still has its score on its LAST valid token.
    scores = T_([1.0, 2.0])
    mask = T_([[1.0, 1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0]])
    out = token_level_rewards(scores, mask)
    assert_close(out, T_([[0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0]]), rtol=0, atol=0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_token_level_rewards_with_kl_vs_naive(estimator):
    g = torch.Generator().manual_seed(5)
    lengths = [4, 2, 0, 5, 1]
    mask = make_mask(lengths, 5)
    scores = torch.randn(5, generator=g, dtype=DT)
    old = -torch.rand(5, 5, generator=g, dtype=DT) * 2
    ref = old + torch.randn(5, 5, generator=g, dtype=DT) * 0.3
    pad = mask == 0
    out = token_level_rewards(scores, mask, old_logprobs=old.masked_fill(pad, float("nan")),
                              ref_logprobs=ref.masked_fill(pad, float("inf")), kl_coef=0.3, kl_estimator=estimator)
    expected = n_token_rewards(scores.tolist(), mask.tolist(), old.tolist(), ref.tolist(), 0.3, estimator)
    assert_close(out, T_(expected), rtol=1e-12, atol=1e-12)


def test_token_level_kl_hand_case_k1():
    # KL(old, ref) with k1 = old - ref: tokens (old, ref) = (-1, -1.5), (-2, -1)
    # -> k1 = 0.5, -1.0; rewards: -0.1 * 0.5 = -0.05 ; 3 - 0.1 * (-1) = 3.1
    out = token_level_rewards(T_([3.0]), T_([[1.0, 1.0, 0.0]]), old_logprobs=T_([[-1.0, -2.0, 0.0]]),
                              ref_logprobs=T_([[-1.5, -1.0, 0.0]]), kl_coef=0.1, kl_estimator="k1")
    assert_close(out, T_([[-0.05, 3.1, 0.0]]))


def test_token_level_kl_needs_old_logprobs():
    with pytest.raises(ValueError):
        token_level_rewards(T_([1.0]), T_([[1.0]]), ref_logprobs=T_([[0.0]]), kl_coef=0.1)


# --------------------------------------------------------------------------------------
# step 5: estimators
# --------------------------------------------------------------------------------------


def _random_token_rewards(seed, lengths, T, outcome_only=True):
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(lengths, T)
    scores = torch.randn(len(lengths), generator=g, dtype=DT) * 2
    if outcome_only:
        tok = T_(n_token_rewards(scores.tolist(), mask.tolist()))
    else:
        tok = torch.randn(len(lengths), T, generator=g, dtype=DT) * mask
    return scores, mask, tok


@pytest.mark.parametrize("outcome_only", [True, False])
@pytest.mark.parametrize("estimator", ["grpo", "reinforce", "rloo", "dr_grpo"])
def test_estimators_vs_naive(estimator, outcome_only):
    lengths = [3, 5, 1, 4, 2, 5, 4, 3, 0, 2, 5, 1]  # 3 groups of 4
    _, mask, tok = _random_token_rewards(6, lengths, 5, outcome_only)
    out = compute_advantages(tok.masked_fill(mask == 0, float("nan")), mask, 4, estimator, eps=0.01)
    expected = n_advantages(tok.tolist(), mask.tolist(), 4, estimator, eps=0.01)
    assert_close(out, T_(expected), rtol=1e-12, atol=1e-12)


def test_grpo_by_hand():
    # group [1, 2, 3] -> mean 2, std 1, eps 0.1 -> [-1/1.1, 0, 1/1.1]; group [5, 5, 5] -> 0
    mask = make_mask([2, 1, 3, 1, 1, 2], 3)
    tok = T_(n_token_rewards([1.0, 2.0, 3.0, 5.0, 5.0, 5.0], mask.tolist()))
    out = compute_advantages(tok, mask, 3, "grpo", eps=0.1)
    a = [-1 / 1.1, 0.0, 1 / 1.1, 0.0, 0.0, 0.0]
    assert_close(out, T_([[a[i] if mask[i, t] else 0.0 for t in range(3)] for i in range(6)]))
    assert torch.isfinite(out).all()


def test_rloo_and_dr_grpo_by_hand():
    # group [1, 2, 6]: rloo = r - mean(others) = [1 - 4, 2 - 3.5, 6 - 1.5]; dr_grpo = r - 3
    mask = torch.ones(3, 2, dtype=DT)
    tok = T_([[0.0, 1.0], [0.0, 2.0], [0.0, 6.0]])
    assert_close(compute_advantages(tok, mask, 3, "rloo"), T_([[-3.0, -3.0], [-1.5, -1.5], [4.5, 4.5]]))
    assert_close(compute_advantages(tok, mask, 3, "dr_grpo"), T_([[-2.0, -2.0], [-1.0, -1.0], [3.0, 3.0]]))


def test_reinforce_outcome_reward_is_r_on_every_valid_token():
    lengths = [3, 1, 0, 4]
    mask = make_mask(lengths, 4)
    r = [0.5, -2.0, 9.0, 3.0]
    out = compute_advantages(T_(n_token_rewards(r, mask.tolist())), mask, 1, "reinforce")
    assert_close(out, T_([[r[i] if t < lengths[i] else 0.0 for t in range(4)] for i in range(4)]), rtol=0, atol=0)


def test_reinforce_return_to_go_by_hand():
    tok = T_([[1.0, 2.0, 3.0, 100.0]])
    mask = T_([[1.0, 1.0, 1.0, 0.0]])
    assert_close(compute_advantages(tok, mask, 1, "reinforce"), T_([[6.0, 5.0, 3.0, 0.0]]))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo"])
def test_group_estimators_with_group_size_one_raise(estimator):
    mask = torch.ones(4, 2, dtype=DT)
    with pytest.raises(ValueError):
        compute_advantages(torch.ones(4, 2, dtype=DT), mask, 1, estimator)


def test_unknown_estimator_raises():
    with pytest.raises(ValueError):
        compute_advantages(torch.ones(4, 2, dtype=DT), torch.ones(4, 2, dtype=DT), 2, "ppo")


def test_identical_group_rewards_give_zero_grpo_advantage_not_nan():
    mask = torch.ones(4, 3, dtype=DT)
    tok = T_(n_token_rewards([1.0] * 4, mask.tolist()))
    for est in ("grpo", "rloo", "dr_grpo"):
        out = compute_advantages(tok, mask, 4, est)
        assert_close(out, torch.zeros(4, 3, dtype=DT), rtol=0, atol=0, msg=est)


# --------------------------------------------------------------------------------------
# step 6: whitening
# --------------------------------------------------------------------------------------


def test_whiten_valid_tokens_only():
    g = torch.Generator().manual_seed(7)
    mask = make_mask([5, 2, 0, 4, 1], 5)
    vals = torch.randn(5, 5, generator=g, dtype=DT) * 3 + 2
    out = whiten(vals.masked_fill(mask == 0, float("nan")), mask)
    valid = mask.bool()
    flat = out[valid].tolist()
    assert abs(n_mean(flat)) < 1e-12
    assert math.isclose(n_std(flat), 1.0, rel_tol=1e-5)  # std / (std + 1e-6)
    assert (out[~valid] == 0).all()
    # exact formula with a visible eps
    out = whiten(vals, mask, eps=0.5)
    assert_close(out, T_(n_whiten(vals.tolist(), mask.tolist(), eps=0.5)), rtol=1e-12, atol=1e-12)


def run_on_two_ranks(fn, shards):
    """Run ``fn(shard, reduce_sum)`` on two threads whose ``reduce_sum`` adds both ranks'
    tensors, as an all_reduce would: whatever statistics ``fn`` exchanges, and however
    often, the result is the one over the union of the shards."""
    barrier = threading.Barrier(2)
    slots, results = [None, None], [None, None]

    def reducer(rank):
        def reduce_sum(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        return reduce_sum

    def worker(rank):
        results[rank] = fn(shards[rank], reducer(rank))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_whiten_and_batch_norm_sum_statistics_over_ranks():
    # two ranks: rows 0-2 on one, rows 3-5 on the other; each must see the global statistics
    g = torch.Generator().manual_seed(8)
    mask = make_mask([3, 1, 4, 2, 0, 4], 4)
    vals = torch.randn(6, 4, generator=g, dtype=DT)
    out = run_on_two_ranks(lambda shard, red: whiten(shard[0], shard[1], eps=0.1, reduce_sum=red),
                           [(vals[:3], mask[:3]), (vals[3:], mask[3:])])
    assert_close(torch.cat(out), T_(n_whiten(vals.tolist(), mask.tolist(), eps=0.1)), rtol=1e-12, atol=1e-12)

    r = torch.randn(8, generator=g, dtype=DT)
    out = run_on_two_ranks(lambda shard, red: normalize_rewards(shard, 2, "batch", eps=0.1, reduce_sum=red), [r[:4], r[4:]])
    assert_close(torch.cat(out), T_(n_normalize(r.tolist(), 2, "batch", eps=0.1)), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------
# steps 2-7 together
# --------------------------------------------------------------------------------------


def test_pipeline_order_normalize_clip_token_estimator_whiten_clip():
    # group 0 = [0, 0, 0, 100]: normalized first = [-0.5, -0.5, -0.5, 1.5] (mean 25, std 50),
    # then clipped to 1 -> [-0.5, -0.5, -0.5, 1]. Clipped first it would be [0, 0, 0, 1] ->
    # normalized [-0.5, -0.5, -0.5, 1.5]. Whitening then clipping at 1 differs likewise.
    scores = [0.0, 0.0, 0.0, 100.0, 3.0, -1.0, 2.0, 2.5]
    lengths = [2, 4, 1, 3, 4, 2, 3, 1]
    mask = make_mask(lengths, 4)
    kw = dict(reward_norm="group", reward_clip=1.0, whiten_advantages=True, advantage_clip=1.0, eps=1e-6)
    for est in ("reinforce", "dr_grpo", "grpo", "rloo"):
        norm_scores, adv = rewards_to_advantages(T_(scores), mask, 4, adv_estimator=est, **kw)
        r_exp, adv_exp = n_pipeline(scores, mask.tolist(), 4, est=est, norm="group", reward_clip=1.0,
                                    whiten_adv=True, adv_clip=1.0)
        assert_close(norm_scores, T_(r_exp), msg=est)
        assert_close(adv, T_(adv_exp), msg=est)

    # the case discriminates the order: other orders give other answers
    ml = mask.tolist()
    r = n_normalize([n_clip(x, 1.0) for x in scores], 4, "group")  # clip before normalize
    wrong1 = n_whiten(n_advantages(n_token_rewards(r, ml), ml, 4, "reinforce"), ml)
    wrong1 = [[n_clip(a, 1.0) if ml[i][t] else 0.0 for t, a in enumerate(row)] for i, row in enumerate(wrong1)]
    r = [n_clip(x, 1.0) for x in n_normalize(scores, 4, "group")]
    adv = [[n_clip(a, 1.0) if ml[i][t] else 0.0 for t, a in enumerate(row)]
           for i, row in enumerate(n_advantages(n_token_rewards(r, ml), ml, 4, "reinforce"))]
    wrong2 = n_whiten(adv, ml)  # clip advantages before whitening
    _, right = rewards_to_advantages(T_(scores), mask, 4, adv_estimator="reinforce", **kw)
    for wrong in (wrong1, wrong2):
        assert (right - T_(wrong)).abs().max() > 1e-2


def test_pipeline_with_token_level_kl_vs_naive():
    g = torch.Generator().manual_seed(9)
    lengths = [3, 4, 1, 2, 4, 4]
    mask = make_mask(lengths, 4)
    scores = (torch.randn(6, generator=g, dtype=DT) * 5).tolist()
    old = -torch.rand(6, 4, generator=g, dtype=DT)
    ref = old + torch.randn(6, 4, generator=g, dtype=DT) * 0.5
    for est in ("grpo", "reinforce"):
        _, adv = rewards_to_advantages(T_(scores), mask, 3, adv_estimator=est, reward_norm="batch", reward_clip=1.5,
                                       add_token_level_kl=True, old_logprobs=old, ref_logprobs=ref, kl_coef=0.2,
                                       kl_estimator="k3", whiten_advantages=True, advantage_clip=1.2)
        _, expected = n_pipeline(scores, mask.tolist(), 3, est=est, norm="batch", reward_clip=1.5, whiten_adv=True,
                                 adv_clip=1.2, old=old.tolist(), ref=ref.tolist(), kl_coef=0.2, kl_est="k3")
        assert_close(adv, T_(expected), msg=est)
    # add_token_level_kl False: reference log-probs are ignored
    _, adv = rewards_to_advantages(T_(scores), mask, 3, adv_estimator="reinforce", old_logprobs=old,
                                   ref_logprobs=ref, kl_coef=0.2, add_token_level_kl=False)
    _, expected = n_pipeline(scores, mask.tolist(), 3, est="reinforce")
    assert_close(adv, T_(expected))
    with pytest.raises(ValueError):
        rewards_to_advantages(T_(scores), mask, 3, adv_estimator="reinforce", add_token_level_kl=True, kl_coef=0.1)


def test_roll_example_settings():
    # adv_estimator reinforce, reward_norm null, reward_clip 10, whiten_advantages, advantage_clip 2.0
    g = torch.Generator().manual_seed(10)
    G, n_prompts, T = 8, 3, 6
    lengths = torch.randint(0, T + 1, (G * n_prompts,), generator=g).tolist()
    lengths[0] = 0
    lengths[5] = T
    mask = make_mask(lengths, T)
    scores = (torch.randn(G * n_prompts, generator=g, dtype=DT) * 2).tolist()
    scores[5] = 25.0  # an outlier: clipped to 10, then still beyond 2 std after whitening
    scores[0] = -40.0  # on an empty response: clipped, adds nothing
    norm_scores, adv = rewards_to_advantages(
        T_(scores), mask, G, adv_estimator="reinforce", reward_norm=None, reward_shift=False, reward_scale=False,
        reward_clip=10, add_token_level_kl=False, whiten_advantages=True, advantage_clip=2.0,
    )
    # naive, spelled out: clip each score to [-10, 10]; reinforce with an outcome reward puts
    # r_i on every valid token; whiten over all valid tokens; clip to [-2, 2].
    r = [max(-10.0, min(10.0, s)) for s in scores]
    flat = [r[i] for i in range(len(r)) for _ in range(lengths[i])]
    m, s = n_mean(flat), n_std(flat)
    expected = [[max(-2.0, min(2.0, (r[i] - m) / (s + 1e-6))) if t < lengths[i] else 0.0 for t in range(T)]
                for i in range(len(r))]
    assert_close(norm_scores, T_(r))
    assert_close(adv, T_(expected))
    assert (adv.abs() == 2.0).any()  # the advantage clip acted


# --------------------------------------------------------------------------------------
# unscored responses (every reward function returned None): in no statistic, advantage 0
# --------------------------------------------------------------------------------------

# rewards [1, None, None, 0]: the reward composer gives an unscored response total 0
UNSCORED_SCORES = T_([1.0, 0.0, 0.0, 0.0])
UNSCORED = torch.tensor([True, False, False, True])
H = 1 / math.sqrt(2)  # the scored pair {1, 0}: mean 1/2, unbiased std sqrt(1/2); (1 - 1/2) / sqrt(1/2)


def per_response(advantages):
    """(B, T) advantages that are constant over each response's valid tokens -> (B,)"""
    assert torch.equal(advantages, advantages[:, :1].expand_as(advantages))
    return advantages[:, 0]


@pytest.mark.parametrize("estimator, expected", [
    ("grpo", [H, 0.0, 0.0, -H]),  # counting the unscored as 0 gave [+1.5, 0, 0, -0.5]
    ("rloo", [1.0, 0.0, 0.0, -1.0]),  # R_i minus the other scored one
    ("dr_grpo", [0.5, 0.0, 0.0, -0.5]),  # R_i minus the scored mean 1/2
    ("reinforce", [1.0, 0.0, 0.0, 0.0]),  # no group: each scored reward on its own
])
def test_unscored_responses_join_no_group_statistic(estimator, expected):
    _, adv = rewards_to_advantages(UNSCORED_SCORES, torch.ones(4, 3, dtype=DT), 4, adv_estimator=estimator,
                                   scored=UNSCORED)
    assert_close(per_response(adv), T_(expected), rtol=0, atol=2e-6)  # eps = 1e-6 on the std


def test_unscored_responses_with_group_norm_and_whitening():
    mask = torch.ones(4, 2, dtype=DT)
    scores, adv = rewards_to_advantages(UNSCORED_SCORES, mask, 4, adv_estimator="reinforce", reward_norm="group",
                                        scored=UNSCORED)
    assert_close(scores[UNSCORED], T_([H, -H]), rtol=0, atol=2e-6)
    assert_close(per_response(adv), T_([H, 0.0, 0.0, -H]), rtol=0, atol=2e-6)
    # whitened over the 4 tokens of the scored pair: values +-H, mean 0, unbiased std
    # sqrt(4 H^2 / 3) = sqrt(2/3); H / sqrt(2/3) = sqrt(3)/2 (the 4 unscored zeros are left out)
    _, adv = rewards_to_advantages(UNSCORED_SCORES, mask, 4, adv_estimator="grpo", whiten_advantages=True,
                                   scored=UNSCORED)
    assert_close(per_response(adv), T_([math.sqrt(3) / 2, 0.0, 0.0, -math.sqrt(3) / 2]), rtol=0, atol=1e-5)


# two groups: [1, None, None, 0] and [3, 2, None, 1]. Scored {1, 0, 3, 2, 1}: mean 7/5,
# squared deviations 0.16 + 1.96 + 2.56 + 0.36 + 0.16 = 5.2, unbiased std sqrt(5.2 / 4) = sqrt(1.3)
BATCH_SCORES = T_([1.0, 0.0, 0.0, 0.0, 3.0, 2.0, 0.0, 1.0])
BATCH_SCORED = torch.tensor([True, False, False, True, True, True, False, True])


def test_unscored_responses_join_no_batch_or_running_statistic():
    expected = T_([(r - 1.4) / math.sqrt(1.3) if s else 0.0 for r, s in zip(BATCH_SCORES.tolist(), BATCH_SCORED.tolist())])
    mask = torch.ones(8, 2, dtype=DT)
    for norm in ("batch", "running"):
        running = RunningMoments()
        _, adv = rewards_to_advantages(BATCH_SCORES, mask, 4, adv_estimator="reinforce", reward_norm=norm,
                                       running=running, scored=BATCH_SCORED)
        assert_close(per_response(adv), expected, rtol=0, atol=1e-5)
    assert (running.count, running.mean) == (5.0, pytest.approx(1.4)) and running.std == pytest.approx(math.sqrt(1.3))
    # a step with nothing scored leaves the history as it was
    rewards_to_advantages(T_([0.0] * 4), torch.ones(4, 2, dtype=DT), 4, adv_estimator="reinforce",
                          reward_norm="running", running=running, scored=torch.zeros(4, dtype=torch.bool))
    assert running.count == 5.0


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo"])
def test_a_group_with_one_scored_response_teaches_nothing(estimator):
    scores, scored = T_([0.0, 5.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), torch.tensor([False, True, False, False] + [False] * 4)
    _, adv = rewards_to_advantages(scores, torch.ones(8, 2, dtype=DT), 4, adv_estimator=estimator, scored=scored)
    assert torch.equal(adv, torch.zeros_like(adv))
    # with group normalization a lone scored reward normalizes to 0 under any estimator
    _, adv = rewards_to_advantages(scores, torch.ones(8, 2, dtype=DT), 4, adv_estimator="reinforce",
                                   reward_norm="group", scored=scored)
    assert torch.equal(adv, torch.zeros_like(adv))
