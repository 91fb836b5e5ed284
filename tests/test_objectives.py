"""The objectives beside PPO's clip (``policy_loss_type``: sapo, cispo, gmpo; docs/algorithm.md).

Expected values are computed independently of the code under test: literal numbers worked
out by hand (the arithmetic in the comments), and the plain-Python loop reference
``naive_objective_losses`` below (``math.exp``, one loop per response and per token), whose
gradients are central finite differences, never autograd through the code under test.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.testing import assert_close

from gspo_lightning.objective.loss import policy_loss
from gspo_lightning.objective.loss import OBJECTIVES
from gspo_lightning.training.config import BLOCK_OF, BLOCKS, OBJECTIVE_KEYS, ModuleSettings, nest_flat_keys
from tests.helpers_loss import DT, LEVELS, MODES, make_mask, naive_aggregate, naive_kl, random_batch

NEW = ("sapo", "cispo", "gmpo")
# (type, level) pairs that exist: gmpo's ratio is a sequence ratio
PAIRS = [(t, lv) for t in ("sapo", "cispo") for lv in LEVELS] + [("gmpo", "seq")]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# --------------------------------------------------------------------------------------
# naive reference
# --------------------------------------------------------------------------------------


def naive_objective_losses(lp, old, adv, mask, *, loss_type, level, clip_low=0.2, clip_high=0.28, tau_pos=1.0,
                           tau_neg=1.05, ref=None, kl_coef=0.0, sg=None):
    """Per response, the list of (t, token loss). Plain lists in. ``sg``: the log-probs at which
    stop-gradient parts are frozen (``seq-token``'s ``sg(log s_i)`` and ``sg(lp)``, CISPO's
    whole weight), so finite differences of this function give the gradient; ``None``: ``lp``."""
    sg = lp if sg is None else sg
    out = []
    for i in range(len(mask)):
        valid = [t for t in range(len(mask[i])) if mask[i][t] != 0]
        n = len(valid)
        tok_adv = {t: adv[i][t] if isinstance(adv[i], list) else adv[i] for t in valid}

        def log_ratio(t, source):
            """The level's log-ratio, with the stop-gradient parts taken from ``sg``."""
            if level == "token":
                return source[i][t] - old[i][t]
            seq_log = sum(sg[i][u] - old[i][u] for u in valid) / n
            if level == "seq":
                return sum(source[i][u] - old[i][u] for u in valid) / n
            return seq_log + source[i][t] - sg[i][t]  # seq-token

        losses = []
        if loss_type == "gmpo":
            seq_adv = sum(tok_adv.values()) / n if n else 0.0
            clipped = []
            for t in valid:
                d = lp[i][t] - old[i][t]
                if seq_adv > 0:
                    d = min(d, clip_high)
                elif seq_adv < 0:
                    d = max(d, -clip_low)
                else:
                    d = 0.0
                clipped.append(d)
            weight = math.exp(sum(clipped) / n) if n else 1.0
            losses = [(t, -seq_adv * weight) for t in valid]
        else:
            for t in valid:
                a = tok_adv[t]
                if loss_type == "sapo":
                    w = math.exp(log_ratio(t, lp))
                    tau = tau_pos if a > 0 else tau_neg
                    loss = -_sigmoid(tau * (w - 1.0)) * 4.0 / tau * a
                else:  # cispo: the weight is frozen entirely
                    w = math.exp(log_ratio(t, sg))
                    weight = min(max(w, max(0.0, 1.0 - clip_low)), 1.0 + clip_high)
                    loss = -weight * a * lp[i][t]
                losses.append((t, loss))
        if ref is not None and kl_coef:
            losses = [(t, l + kl_coef * naive_kl(lp[i][t], ref[i][t], "k3")) for t, l in losses]
        out.append(losses)
    return out


def naive_loss(lp, old, adv, mask, *, mode, horizon=None, num_seqs=None, num_tokens=None, ref=None, sg=None, **kw):
    per_seq = naive_objective_losses(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(),
                                     ref=ref.tolist() if ref is not None else None,
                                     sg=sg.tolist() if sg is not None else None, **kw)
    return naive_aggregate(per_seq, mode, horizon=horizon or mask.shape[-1], num_seqs=num_seqs, num_tokens=num_tokens)


def naive_grad(lp, old, adv, mask, *, h=1e-6, **kw):
    base = lp.detach().clone().to(DT)
    grad = torch.zeros_like(base)
    for i in range(base.shape[0]):
        for t in range(base.shape[1]):
            plus, minus = base.clone(), base.clone()
            plus[i, t] += h
            minus[i, t] -= h
            grad[i, t] = (naive_loss(plus, old, adv, mask, sg=base, **kw) - naive_loss(minus, old, adv, mask, sg=base, **kw)) / (2 * h)
    return grad


def loss_kw(loss_type, level):
    """Settings under which the random batches exercise every branch: SAPO's gate steep enough
    to saturate some tokens, CISPO's and GMPO's clips narrow enough to act on both sides."""
    if loss_type == "sapo":  # sequence ratios, means of ~5 token ratios, stay nearer 1: a steeper gate
        return dict(sapo_tau_pos=6.0, sapo_tau_neg=8.0) if level == "token" else dict(sapo_tau_pos=10.0, sapo_tau_neg=12.0)
    if loss_type == "cispo":
        return dict(clip_low=0.2, clip_high=0.25) if level == "token" else dict(clip_low=0.15, clip_high=0.2)
    return dict(clip_low=0.25, clip_high=0.2)


def naive_kw(kw):
    rename = {"sapo_tau_pos": "tau_pos", "sapo_tau_neg": "tau_neg"}
    return {rename.get(k, k): v for k, v in kw.items()}


# --------------------------------------------------------------------------------------
# by hand
# --------------------------------------------------------------------------------------


def test_sapo_token_level_by_hand():
    # response 0: ratios 1.5 and 0.8, A = +2 (tau_pos = 1); response 1: ratio 1.2, A = -1 (tau_neg = 1.05)
    old = torch.tensor([[math.log(0.5), math.log(0.25)], [math.log(0.4), 0.0]], dtype=DT)
    lp = (old + torch.tensor([[math.log(1.5), math.log(0.8)], [math.log(1.2), 0.0]], dtype=DT)).requires_grad_(True)
    mask = make_mask([2, 1], 2)
    loss, metrics = policy_loss(lp, old, torch.tensor([2.0, -1.0], dtype=DT), mask, importance_sampling="token",
                                policy_loss_type="sapo")
    loss.backward()
    # token losses -4 sigmoid(0.5) * 2 = -4.97967, -4 sigmoid(-0.2) * 2 = -3.60133; response 1:
    # +4 sigmoid(1.05 * 0.2) / 1.05 = 2.10403; seq-mean-token-mean: ((-4.97967 - 3.60133) / 2 + 2.10403) / 2
    assert_close(loss, torch.tensor(-1.093235601922896, dtype=DT))
    # gradient: -4 g (1 - g) * r * A / (L_i N), the sigmoid-derivative-shaped weight times the policy gradient
    # (0.940015 * 1.5 * 2 / 4, 0.990066 * 0.8 * 2 / 4, 0.989056 * 1.2 * -1 / 2)
    assert_close(lp.grad, torch.tensor([[-0.7050111366047835, -0.39602651633897595], [0.5934333182303141, 0.0]], dtype=DT))
    # gate weights 0.940015, 0.990066, 0.989056: none below 1/2
    assert_close(metrics["gate_weight_mean"], torch.tensor((0.940014848806378 + 0.9900662908474398 + 0.9890555303838569) / 3),
                 check_dtype=False)
    assert metrics["gate_saturated_frac"].item() == 0.0
    assert "clip_frac" not in metrics and "dual_clip_frac" not in metrics


def test_sapo_gate_saturation_by_hand():
    # ratios 3.0 (A > 0, tau 1: gate weight 4 sigmoid(2) (1 - sigmoid(2)) = 0.41997 < 1/2) and 1.0 (weight 1),
    # and one ratio 0.2 with tau 10 (weight 4 sigmoid(-8) (1 - sigmoid(-8)) = 0.00134): saturated low
    old = torch.zeros(3, 1, dtype=DT)
    lp = torch.tensor([[math.log(3.0)], [0.0], [math.log(0.2)]], dtype=DT)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=DT)
    _, m = policy_loss(lp, old, adv, torch.ones(3, 1, dtype=DT), importance_sampling="token", policy_loss_type="sapo",
                       sapo_tau_pos=1.0, sapo_tau_neg=10.0)
    weight_low = 4 * _sigmoid(-8) * (1 - _sigmoid(-8))
    assert_close(m["gate_weight_mean"], torch.tensor((0.41997434161402647 + 1.0 + weight_low) / 3), check_dtype=False)
    assert_close(m["gate_saturated_frac_high"], torch.tensor(1 / 3))
    assert_close(m["gate_saturated_frac_low"], torch.tensor(1 / 3))
    assert_close(m["gate_saturated_frac"], torch.tensor(2 / 3))


def test_sapo_sequence_level_gates_the_geometric_mean_ratio():
    # one response of 2 tokens, log-ratios 0.3 and -0.1: s = exp(0.1), A = +1, tau 2
    old = torch.tensor([[-1.0, -2.0]], dtype=DT)
    lp = (old + torch.tensor([[0.3, -0.1]], dtype=DT)).requires_grad_(True)
    loss, m = policy_loss(lp, old, torch.tensor([1.0], dtype=DT), torch.ones(1, 2, dtype=DT), importance_sampling="seq",
                          policy_loss_type="sapo", sapo_tau_pos=2.0)
    loss.backward()
    s = math.exp(0.1)
    g = _sigmoid(2.0 * (s - 1.0))
    assert_close(loss, torch.tensor(-g * 4.0 / 2.0, dtype=DT))
    # d/d lp_t of -f(s): -4 g (1 - g) * s / L on each token (s's log is the mean of the two)
    assert_close(lp.grad, torch.full((1, 2), -4 * g * (1 - g) * s / 2, dtype=DT))
    assert_close(m["ratio_mean"], torch.tensor(s), check_dtype=False)


def test_cispo_by_hand():
    # token level, clip [0.8, 1.28]: response 0 ratios 1.5 (weight 1.28) and 0.7 (weight 0.8), A = +1;
    # response 1 ratio 1.1 (weight 1.1), A = -1
    old = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=DT)
    lp = (old + torch.tensor([[math.log(1.5), math.log(0.7)], [math.log(1.1), 0.0]], dtype=DT)).requires_grad_(True)
    mask = make_mask([2, 1], 2)
    loss, m = policy_loss(lp, old, torch.tensor([1.0, -1.0], dtype=DT), mask, importance_sampling="token",
                          policy_loss_type="cispo", clip_low=0.2, clip_high=0.28, loss_agg_mode="token-mean")
    loss.backward()
    v = lp.detach()
    # token-mean over 3 tokens of -w A lp
    expected = (-1.28 * v[0, 0] - 0.8 * v[0, 1] + 1.1 * v[1, 0]) / 3
    assert_close(loss, expected)
    # the gradient is sg(w) * A * grad lp: the clipped tokens keep theirs (scaled to the bound)
    assert_close(lp.grad, torch.tensor([[-1.28 / 3, -0.8 / 3], [1.1 / 3, 0.0]], dtype=DT))
    # one token over the top, one below the bottom, of 3
    assert_close(m["clip_frac_high"], torch.tensor(1 / 3))
    assert_close(m["clip_frac_low"], torch.tensor(1 / 3))
    assert_close(m["clip_frac"], torch.tensor(2 / 3))


def test_cispo_default_range_has_no_lower_bound_and_caps_the_weight_at_5():
    assert clip_range("token", None, None, "cispo") == (1.0, 4.0)
    assert clip_range("seq", None, None, "cispo") == (1.0, 4.0)
    old = torch.zeros(1, 3, dtype=DT)
    lp = torch.tensor([[math.log(0.01), math.log(7.0), 0.0]], dtype=DT, requires_grad=True)
    loss, m = policy_loss(lp, old, torch.tensor([1.0], dtype=DT), torch.ones(1, 3, dtype=DT), importance_sampling="token",
                          policy_loss_type="cispo", clip_low=1.0, clip_high=4.0, loss_agg_mode="seq-mean-token-sum")
    loss.backward()
    assert_close(lp.grad, torch.tensor([[-0.01, -5.0, -1.0]], dtype=DT))  # weights 0.01 (kept), 7 -> 5, 1
    assert m["clip_frac_low"].item() == 0.0
    assert_close(m["clip_frac_high"], torch.tensor(1 / 3))


def test_gmpo_by_hand():
    # response 0: token log-ratios 0.5, -0.1, 0.2 with A = +1, clip 0.4: the first clipped to 0.4 (above
    # only), mean 0.5 / 3, weight exp(1/6) = 1.181360; response 1: -0.5, 0.1, 0.6 with A = -1: the first
    # clipped to -0.4 (below only), mean 0.1, weight exp(0.1) = 1.105171
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], dtype=DT)
    d = torch.tensor([[0.5, -0.1, 0.2], [-0.5, 0.1, 0.6]], dtype=DT)
    lp = (old + d).requires_grad_(True)
    loss, m = policy_loss(lp, old, torch.tensor([1.0, -1.0], dtype=DT), torch.ones(2, 3, dtype=DT), importance_sampling="seq",
                          policy_loss_type="gmpo", clip_low=0.4, clip_high=0.4)
    loss.backward()
    assert_close(loss, torch.tensor((-1.1813604128656459 + 1.1051709180756477) / 2, dtype=DT))
    # -A_i w_i / (L_i N) on the unclipped tokens, 0 on the clipped ones
    g0, g1 = -1.1813604128656459 / 6, 1.1051709180756477 / 6
    assert_close(lp.grad, torch.tensor([[0.0, g0, g0], [0.0, g1, g1]], dtype=DT))
    # a third of response 0's tokens clipped high, a third of response 1's low: 1/6 each over 2 responses
    assert_close(m["clip_frac_high"], torch.tensor(1 / 6))
    assert_close(m["clip_frac_low"], torch.tensor(1 / 6))
    # the ratio metrics are GSPO's unclipped s_i: exp(0.6 / 3), exp(0.2 / 3)
    assert_close(m["ratio_max"], torch.tensor(math.exp(0.2)), check_dtype=False)
    assert_close(m["ratio_min"], torch.tensor(math.exp(0.2 / 3)), check_dtype=False)


def test_gmpo_uses_the_mean_advantage_of_a_response_with_per_token_advantages():
    old = torch.zeros(1, 2, dtype=DT)
    lp = torch.tensor([[0.1, 0.3]], dtype=DT)
    adv = torch.tensor([[1.0, 2.0]], dtype=DT)
    loss, _ = policy_loss(lp, old, adv, torch.ones(1, 2, dtype=DT), policy_loss_type="gmpo", clip_low=0.4, clip_high=0.4)
    assert_close(loss, torch.tensor(-1.5 * math.exp(0.2), dtype=DT))


@pytest.mark.parametrize("level", LEVELS)
def test_on_policy_every_objective_is_the_policy_gradient(level):
    """At ratio 1 (lp = old) each objective's gradient is -A grad lp aggregated: the gate's weight
    is 1, CISPO's weight 1, GMPO's clip inactive; they differ only off-policy."""
    lp, old, ref, adv, mask = random_batch(21, spread=0.0)
    grads = {}
    for loss_type in ("ppo",) + NEW:
        if loss_type == "gmpo" and level != "seq":
            continue
        leaf = old.clone().requires_grad_(True)
        loss, m = policy_loss(leaf, old, adv, mask, importance_sampling=level, policy_loss_type=loss_type)
        loss.backward()
        grads[loss_type] = leaf.grad
        assert m["ratio_mean"].item() == 1.0
    lengths = mask.sum(-1)
    n = (lengths > 0).sum()
    expected = torch.where(mask.bool(), -adv[:, None] / lengths.clamp(min=1)[:, None] / n, torch.zeros_like(mask))
    for loss_type, grad in grads.items():
        assert_close(grad, expected, msg=loss_type)


# --------------------------------------------------------------------------------------
# against the naive reference: every aggregation, value and gradient
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["adv(B)", "adv(B,T)"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type, level", PAIRS)
def test_objective_matches_naive_reference(loss_type, level, mode, per_token_adv):
    lp, old, ref, adv, mask = random_batch(31, per_token_adv=per_token_adv, spread=0.4)
    kw = loss_kw(loss_type, level)
    leaf = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(leaf, old, adv, mask, importance_sampling=level, loss_agg_mode=mode, policy_loss_type=loss_type,
                          ref_logprobs=ref, kl_coef=0.05, **kw)
    loss.backward()
    nk = dict(loss_type=loss_type, level=level, mode=mode, ref=ref, kl_coef=0.05, **naive_kw(kw))
    assert_close(loss, torch.tensor(naive_loss(lp, old, adv, mask, **nk), dtype=DT), rtol=1e-10, atol=1e-12)
    assert_close(leaf.grad, naive_grad(lp, old, adv, mask, **nk), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type, level", PAIRS)
def test_the_random_batches_exercise_every_branch(loss_type, level):
    """Else the naive comparisons above could pass with a branch never taken."""
    lp, old, ref, adv, mask = random_batch(31, spread=0.4)
    _, m = policy_loss(lp, old, adv, mask, importance_sampling=level, policy_loss_type=loss_type, **loss_kw(loss_type, level))
    prefix = "gate_saturated_frac" if loss_type == "sapo" else "clip_frac"
    assert 0 < m[prefix] < 1, m
    assert m[f"{prefix}_low"] > 0 and m[f"{prefix}_high"] > 0, m
    assert (adv > 0).any() and (adv < 0).any()  # SAPO's two temperatures, GMPO's two clip sides


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", ("sapo", "cispo"))
def test_seq_and_seq_token_identical_with_per_response_advantages(loss_type, mode):
    lp, old, ref, adv, mask = random_batch(41, spread=0.4)
    out = {}
    for level in ("seq", "seq-token"):
        leaf = lp.clone().requires_grad_(True)
        loss, m = policy_loss(leaf, old, adv, mask, importance_sampling=level, loss_agg_mode=mode, policy_loss_type=loss_type,
                              **loss_kw(loss_type, "seq"))
        loss.backward()
        out[level] = (loss, leaf.grad, m)
    assert_close(out["seq"][0], out["seq-token"][0], rtol=1e-12, atol=1e-14)
    assert_close(out["seq"][1], out["seq-token"][1], rtol=1e-10, atol=1e-14)
    assert out["seq"][2].keys() == out["seq-token"][2].keys()


# --------------------------------------------------------------------------------------
# micro-batches, masks, bad values
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["adv(B)", "adv(B,T)"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type, level", PAIRS)
def test_micro_batch_invariance(loss_type, level, mode, per_token_adv):
    lengths = (5, 1, 7, 3, 0, 6, 4, 2)
    T = 8
    lp, old, ref, adv, mask = random_batch(8, lengths=lengths, T=T, per_token_adv=per_token_adv, spread=0.4)
    kw = dict(importance_sampling=level, loss_agg_mode=mode, policy_loss_type=loss_type, kl_coef=0.05, **loss_kw(loss_type, level))
    full = lp.clone().requires_grad_(True)
    loss_full, _ = policy_loss(full, old, adv, mask, ref_logprobs=ref, **kw)
    loss_full.backward()
    num_seqs, num_tokens = sum(1 for L in lengths if L > 0), int(mask.sum().item())
    micro = lp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=DT)
    for lo, hi in [(0, 2), (2, 3), (3, 8)]:
        t_max = max(max(lengths[lo:hi]), 1)  # each micro-batch padded to its own length
        sl = (slice(lo, hi), slice(0, t_max))
        a = adv[lo:hi, :t_max] if per_token_adv else adv[lo:hi]
        loss, _ = policy_loss(micro[sl], old[sl], a, mask[sl], ref_logprobs=ref[sl], num_seqs=num_seqs,
                              num_tokens=num_tokens, horizon=T, **kw)
        total = total + loss
    total.backward()
    assert_close(total, loss_full, rtol=1e-12, atol=1e-14)
    assert_close(micro.grad, full.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("loss_type, level", PAIRS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_values_at_masked_positions(loss_type, level, bad):
    lp, old, ref, adv, mask = random_batch(10, per_token_adv=True)
    kw = dict(importance_sampling=level, policy_loss_type=loss_type, kl_coef=0.1, **loss_kw(loss_type, level))
    clean = lp.clone().requires_grad_(True)
    loss_clean, _ = policy_loss(clean, old, adv, mask, ref_logprobs=ref, **kw)
    loss_clean.backward()
    pad = mask == 0
    dirty = lp.masked_fill(pad, bad).requires_grad_(True)
    loss, metrics = policy_loss(dirty, old.masked_fill(pad, bad), adv.masked_fill(pad, bad), mask,
                                ref_logprobs=ref.masked_fill(pad, bad), **kw)
    loss.backward()
    assert_close(loss, loss_clean)
    assert_close(dirty.grad, clean.grad)
    assert all(torch.isfinite(v).all() for v in metrics.values()), metrics


@pytest.mark.parametrize("loss_type, level", PAIRS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_huge_log_ratios_give_finite_loss_and_gradient(loss_type, level, sign):
    mask = make_mask([3, 2, 0], 4)
    old = torch.full((3, 4), -2.0)
    lp = (old + sign * 1000.0).requires_grad_(True)
    loss, metrics = policy_loss(lp, old, torch.tensor([1.0, -1.0, 1.0]), mask, importance_sampling=level,
                                policy_loss_type=loss_type)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v).all() for v in metrics.values()), metrics


@pytest.mark.parametrize("loss_type, level", PAIRS)
def test_empty_response_adds_nothing_and_is_not_counted(loss_type, level):
    lp, old, ref, adv, mask = random_batch(9, lengths=(3, 5, 2), T=5, spread=0.4)
    kw = dict(importance_sampling=level, policy_loss_type=loss_type, **loss_kw(loss_type, level))
    base, base_m = policy_loss(lp, old, adv, mask, **kw)
    pad = lambda x, v: torch.cat([x, torch.full((1, 5), v, dtype=DT)])  # noqa: E731
    with_empty, m = policy_loss(pad(lp, 3.0), pad(old, -7.0), torch.cat([adv, torch.tensor([100.0], dtype=DT)]),
                                pad(mask, 0.0), **kw)
    assert_close(with_empty, base, rtol=1e-12, atol=1e-14)
    for name in base_m:
        assert_close(m[name], base_m[name], msg=name)


def test_ppo_is_the_default_and_the_same_bits():
    lp, old, ref, adv, mask = random_batch(51, spread=0.4)
    for level in LEVELS:
        kw = dict(importance_sampling=level, clip_low=0.1, clip_high=0.12, dual_clip=2.0, ref_logprobs=ref, kl_coef=0.01)
        (a, ma), (b, mb) = (policy_loss(lp, old, adv, mask, **kw),
                            policy_loss(lp, old, adv, mask, policy_loss_type="ppo", **kw))
        assert torch.equal(a, b) and ma.keys() == mb.keys()
        assert all(torch.equal(ma[k], mb[k]) for k in ma)
        assert {"clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean"} <= set(ma)


# --------------------------------------------------------------------------------------
# bad combinations: the pure function
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy_loss_type="grpo"), "policy_loss_type must be one of 'ppo', 'sapo', 'cispo', 'gmpo'"),
    (dict(policy_loss_type="sapo", sapo_tau_pos=0.0), "tau_pos must be > 0"),
    (dict(policy_loss_type="sapo", sapo_tau_neg=-1.05), "must be > 0"),
    (dict(policy_loss_type="cispo", dual_clip=3.0), "dual_clip bounds PPO's clipped surrogate"),
    (dict(policy_loss_type="gmpo", importance_sampling="token"), "set importance_sampling: seq"),
    (dict(policy_loss_type="gmpo", importance_sampling="seq-token"), "set importance_sampling: seq"),
])
def test_bad_combinations_raise(kwargs, message):
    lp, old, ref, adv, mask = random_batch(12, lengths=(2, 3), T=3)
    with pytest.raises(ValueError, match=message):
        policy_loss(lp, old, adv, mask, **kwargs)


# --------------------------------------------------------------------------------------
# bad combinations: the config (GSPOModule's keys)
# --------------------------------------------------------------------------------------


def validate(**flat_keys):
    """``GSPOModule``'s blocks built and checked from its flat keys (``training/config.py``)."""
    blocks, _ = nest_flat_keys(flat_keys)
    return ModuleSettings.build(**{name: blocks.get(name) for name in BLOCKS})


@pytest.mark.parametrize("overrides, message", [
    (dict(policy_loss_type="reinforce"), "policy_loss_type must be one of"),
    (dict(policy_loss_type="sapo", sapo_tau_pos=0.0), "tau_pos must be > 0"),
    (dict(policy_loss_type="sapo", sapo_tau_neg=-1.0), "tau_neg must be > 0"),
    (dict(sapo_tau_pos=2.0), "sapo_tau_pos is not a setting of the ppo objective"),
    (dict(policy_loss_type="cispo", sapo_tau_neg=2.0), "sapo_tau_neg is not a setting of the cispo objective"),
    (dict(policy_loss_type="sapo", clip_high=0.2), "clip_high is not a setting of the sapo objective"),
    (dict(policy_loss_type="gmpo", dual_clip_loss=True), "dual_clip is not a setting of the gmpo objective"),
    (dict(policy_loss_type="gmpo", importance_sampling="token"), "gmpo's ratio is the geometric mean"),
    (dict(policy_loss_type="gmpo", add_token_level_kl=True, kl_coef=0.1), "turn add_token_level_kl off"),
])
def test_config_rejects_bad_combinations(overrides, message):
    with pytest.raises(ValueError) as err:
        validate(**overrides)
    assert message in str(err.value)


@pytest.mark.parametrize("overrides", [
    dict(policy_loss_type="sapo", importance_sampling="token"),
    dict(policy_loss_type="sapo", importance_sampling="token", sapo_tau_pos=2.0, sapo_tau_neg=3.0),
    dict(policy_loss_type="cispo", clip_low=1.0, clip_high=4.0),  # no lower bound: clip_low >= 1 is fine here
    dict(policy_loss_type="cispo", importance_sampling="seq-token"),
    dict(policy_loss_type="gmpo", clip_low=0.4, clip_high=0.4, loss_agg_mode="token-mean"),
    dict(policy_loss_type="sapo", importance_sampling="token", clip_budget=True),
])
def test_config_accepts_good_combinations_silently(overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate(**overrides)


def test_ppo_still_rejects_clip_low_of_1():
    with pytest.raises(ValueError, match="clip_low must be < 1"):
        validate(clip_low=1.0)


def test_sapo_at_sequence_level_with_the_papers_temperatures_warns_that_the_gate_never_acts():
    with pytest.warns(UserWarning, match="gate passes nearly all of the gradient"):
        validate(policy_loss_type="sapo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate(policy_loss_type="sapo", sapo_tau_pos=4000.0, sapo_tau_neg=4000.0)


def clip_range(level, low, high, name="ppo"):
    """The resolved clip range of objective ``name`` with ``low`` / ``high`` set (None: its default)."""
    given = {key: value for key, value in (("clip_low", low), ("clip_high", high)) if value is not None}
    objective = OBJECTIVES[name](**given).resolved(level)
    return objective.clip_low, objective.clip_high


def test_default_clip_ranges_by_objective():
    assert clip_range("seq", None, None) == (3e-4, 4e-4) == clip_range("seq", None, None, "ppo")
    assert clip_range("token", None, None, "ppo") == (0.2, 0.27)
    assert clip_range("seq", None, None, "gmpo") == (0.4, 0.4)
    assert clip_range("token", None, 5.0, "cispo") == (1.0, 5.0)


# --------------------------------------------------------------------------------------
# the clip budget splits each objective's flags by cause
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type, level", [("ppo", lv) for lv in LEVELS] + PAIRS)
def test_the_clip_budget_counts_what_the_loss_flags(loss_type, level):
    """In bypass (the clip sees numerics + staleness + update), ``clip_budget/clip_frac`` is the
    loss's own ``clip_frac`` (``gate_saturated_frac`` for sapo), and the causes partition it."""
    from gspo_lightning.objective.clip_budget import PARTS, attribute_clips, split_log_ratio

    g = torch.Generator().manual_seed(61)
    mask = make_mask((5, 1, 7, 3, 0, 6, 4), 8).bool()
    b = -torch.rand(7, 8, generator=g, dtype=DT) * 3 - 0.1
    o_b, o, lp = (b + torch.randn(7, 8, generator=g, dtype=DT) * 0.15 * k for k in (1, 2, 3))
    adv = torch.randn(7, generator=g, dtype=DT)
    kw = dict(clip_low=0.1, clip_high=0.12) if level != "token" and loss_type == "ppo" else dict(clip_low=0.2, clip_high=0.25)
    taus = (3.0, 4.0) if level == "token" else (6.0, 8.0)
    if loss_type == "sapo":
        kw = dict(sapo_tau_pos=taus[0], sapo_tau_neg=taus[1])
    _, m = policy_loss(lp, b, adv, mask, importance_sampling=level, policy_loss_type=loss_type, **kw)
    objective = OBJECTIVES[loss_type](tau_pos=taus[0], tau_neg=taus[1]) if loss_type == "sapo" else \
        OBJECTIVES[loss_type](clip_low=kw["clip_low"], clip_high=kw["clip_high"])
    counts = attribute_clips(split_log_ratio(lp, o, b, o_b), PARTS, mask, adv, level=level, objective=objective)
    flagged = m["gate_saturated_frac" if loss_type == "sapo" else "clip_frac"]
    assert 0 < flagged < 1
    assert_close(counts["clipped"] / counts["units"], flagged.to(DT).float(), rtol=1e-6, atol=1e-7, check_dtype=False)
    assert_close(sum(counts[p] for p in PARTS), counts["clipped"], check_dtype=False)


def test_sapo_budget_bounds_are_the_gates_half_weight_points():
    """tau 10: the gate's weight 4 g (1 - g) is 1/2 at w = 1 +- 0.17627 (|10 (w - 1)| = 1.7627);
    tau 1: at w = 2.7627 above, and never below (w > 0)."""
    from gspo_lightning.objective.clip_budget import attribute_clips

    w = torch.tensor([[1.17], [1.18], [0.83], [0.82], [2.76], [2.77], [0.01]], dtype=DT)
    adv = torch.tensor([-1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0], dtype=DT)
    counts = attribute_clips({"update": torch.log(w)}, ("update",), torch.ones(7, 1, dtype=torch.bool), adv, level="token",
                             objective=OBJECTIVES["sapo"](tau_pos=1.0, tau_neg=10.0))
    assert float(counts["clipped"]) == 3.0  # 1.18, 0.82 (tau 10) and 2.77 (tau 1)


# --------------------------------------------------------------------------------------
# the fit path: `gspo fit --config configs/quickstart.yaml --model.policy_loss_type=...`
# --------------------------------------------------------------------------------------

# the metric each objective adds to the logs, beside loss/policy and the ratio's
OWN_METRIC = {"ppo": "loss/clip_frac", "sapo": "loss/gate_saturated_frac", "cispo": "loss/clip_frac", "gmpo": "loss/clip_frac"}


@pytest.mark.parametrize("loss_type", NEW)
def test_each_objective_trains_through_gspo_fit(tmp_path, loss_type):
    """Two rollout steps of the quickstart (4 optimizer steps each): finite losses, the
    objective's metrics logged, and the weights moved between the two steps' checkpoints."""
    import csv
    from pathlib import Path

    from gspo_lightning.cli import main

    root = Path(__file__).resolve().parents[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sapo at the sequence level says its gate is wide open: known here
        main(["fit", "--config", str(root / "configs/quickstart.yaml"), f"--model.policy_loss_type={loss_type}",
              "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
              "--trainer.enable_progress_bar=false", "--model.export_on_fit_end=false",
              f"--trainer.default_root_dir={tmp_path}", f"--checkpoint.dirpath={tmp_path / 'ckpt'}",
              "--checkpoint.every_n_train_steps=1", "--checkpoint.save_top_k=-1"])
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("loss/policy")]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(float(row["loss/policy"])) and math.isfinite(float(row["grad_norm"]))
        assert 0.0 <= float(row[OWN_METRIC[loss_type]]) <= 1.0
        assert float(row["policy_version"]) in (4.0, 8.0)
    if loss_type == "sapo":
        assert 0.0 < float(rows[-1]["loss/gate_weight_mean"]) <= 1.0
    first, second = (torch.load(next((tmp_path / "ckpt").glob(f"*step={n}.ckpt")), weights_only=True)["state_dict"]
                     for n in (1, 2))
    moved = max((second[k] - first[k]).abs().max().item() for k in first if k.startswith("policy."))
    assert moved > 1e-4, "the second step left the weights where they were"


@pytest.mark.slow
def test_the_quickstart_learns_with_token_level_sapo(tmp_path):
    """The paper's SAPO (token level, temperatures 1.0 / 1.05) on the quickstart: from 0 held-out
    accuracy to (measured, seed 0) 1.0 after 50 rollout steps; GSPO's clip reaches 0.89 there."""
    import csv
    import json
    from pathlib import Path

    from gspo_lightning.cli import main

    root = Path(__file__).resolve().parents[1]
    main(["fit", "--config", str(root / "configs/quickstart.yaml"), "--model.policy_loss_type=sapo",
          "--model.importance_sampling=token", "--trainer.max_steps=50", "--trainer.enable_progress_bar=false",
          "--model.export_on_fit_end=false", f"--trainer.default_root_dir={tmp_path}"])
    run = tmp_path / "csv" / "version_0"
    evals = [json.loads(line) for line in (run / "eval_results.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == 50 and evals[-1]["val/accuracy"] >= 0.75, evals
    with open(run / "metrics.csv") as handle:
        rewards = [float(r["reward/mean"]) for r in csv.DictReader(handle) if r.get("reward/mean")]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards


def test_every_staleness_arm_of_the_experiment_is_a_valid_config(tmp_path):
    """experiments/async_staleness.py: each method x correction makes a config the module accepts
    (SAPO's sequence-level arm with a gate sized to sequence ratios, so without the warning)."""
    import yaml

    from tests.helpers import load_script

    script = load_script("experiments/async_staleness.py")
    for method in script.METHODS:
        for correction in script.CORRECTIONS:
            path = script.config(tmp_path / f"{method}-{correction}", seed=0, steps=1, k=1, engine="copy", method=method,
                                 correction=correction)
            model = yaml.safe_load(path.read_text())["model"]
            keys = set(BLOCKS) | set(BLOCK_OF) | set(OBJECTIVE_KEYS)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                # the arm without correction trains stale rollouts as on-policy on purpose (the baseline)
                warnings.filterwarnings("ignore", message=r"max_staleness=\d+ with old_logprobs=recompute and no off_policy")
                blocks, _ = nest_flat_keys({k: v for k, v in model.items() if k in keys})
                ModuleSettings.build(**{name: blocks.get(name) for name in BLOCKS})
