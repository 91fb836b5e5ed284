"""Unit tests of ``gspo_lightning.objective.loss`` (docs: GSPO.md sections 2-4).

Every expected value is computed independently of the code under test: by hand for small
cases, or by the deliberately naive loop reference ``naive_policy_loss`` below (plain Python
floats, ``math.exp``, one loop over responses and one over tokens; the parts the objective
tests share are in ``tests/helpers_loss.py``). Gradients of the naive reference are taken by
central finite differences, never by autograd through the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from gspo_lightning.objective.loss import aggregate_loss, kl_penalty, policy_loss
from tests.helpers_loss import DT, LEVELS, MODES, make_mask, naive_aggregate, naive_kl, random_batch

ESTIMATORS = ("k1", "k2", "k3")


# --------------------------------------------------------------------------------------
# naive reference
# --------------------------------------------------------------------------------------


def naive_token_losses(lp, old, adv, mask, *, level, clip_low, clip_high, dual_clip=None,
                       ref=None, kl_coef=0.0, kl_estimator="k3", stop_grad_lp=None):
    """Per response, the list of (t, token loss) over its valid tokens. Plain lists in.

    ``stop_grad_lp``: for ``seq-token`` only, the log-probs at which the stop-gradient parts
    ``sg(log s_i)`` and ``sg(lp[i,t])`` are frozen (so that finite differences of this
    function give the GSPO-token gradient); ``None`` means ``lp`` itself (the value).
    """
    out = []
    for i in range(len(mask)):
        valid_t = [t for t in range(len(mask[i])) if mask[i][t] != 0]
        length = len(valid_t)
        sg = lp if (stop_grad_lp is None or level != "seq-token") else stop_grad_lp
        seq_log = 0.0
        for t in valid_t:
            seq_log += sg[i][t] - old[i][t]
        if length > 0:
            seq_log /= length
        losses = []
        for t in valid_t:
            a = adv[i] if not isinstance(adv[i], list) else adv[i][t]
            if level == "token":
                log_w = lp[i][t] - old[i][t]
            elif level == "seq":
                log_w = seq_log
            else:  # seq-token: sg(log s_i) + lp[i,t] - sg(lp[i,t])
                log_w = seq_log + lp[i][t] - sg[i][t]
            w = math.exp(log_w)
            cw = min(max(w, 1.0 - clip_low), 1.0 + clip_high)
            obj = min(w * a, cw * a)
            if dual_clip is not None and a < 0:
                obj = max(obj, dual_clip * a)
            loss = -obj
            if ref is not None and kl_coef != 0.0:
                loss += kl_coef * naive_kl(lp[i][t], ref[i][t], kl_estimator)
            losses.append((t, loss))
        out.append(losses)
    return out


def naive_policy_loss(lp, old, adv, mask, *, mode, horizon=None, num_seqs=None, num_tokens=None,
                      ref=None, stop_grad_lp=None, **kw):
    """Naive loss from tensors (converted to lists)."""
    lp_l, old_l, mask_l = lp.tolist(), old.tolist(), mask.tolist()
    adv_l = adv.tolist()
    ref_l = ref.tolist() if ref is not None else None
    sg_l = stop_grad_lp.tolist() if stop_grad_lp is not None else None
    per_seq = naive_token_losses(lp_l, old_l, adv_l, mask_l, ref=ref_l, stop_grad_lp=sg_l, **kw)
    h = horizon if horizon is not None else mask.shape[-1]
    return naive_aggregate(per_seq, mode, horizon=h, num_seqs=num_seqs, num_tokens=num_tokens)


def naive_grad(lp, old, adv, mask, *, h=1e-6, **kw):
    """Central finite differences of the naive loss w.r.t. lp (float64); for ``seq-token``
    the stop-gradient parts stay at ``lp`` (see ``naive_token_losses``)."""
    base = lp.detach().clone().to(DT)
    kw = dict(kw, stop_grad_lp=base)
    grad = torch.zeros_like(base)
    for i in range(base.shape[0]):
        for t in range(base.shape[1]):
            plus, minus = base.clone(), base.clone()
            plus[i, t] += h
            minus[i, t] -= h
            grad[i, t] = (naive_policy_loss(plus, old, adv, mask, **kw) - naive_policy_loss(minus, old, adv, mask, **kw)) / (2 * h)
    return grad


def naive_clip_counts(lp, old, adv, mask, *, level, clip_low, clip_high):
    """(# tokens low-clipped, # tokens high-clipped, # valid tokens) for token-level checks."""
    lp_l, old_l, adv_l, mask_l = lp.tolist(), old.tolist(), adv.tolist(), mask.tolist()
    low = high = n = 0
    for i in range(len(mask_l)):
        valid_t = [t for t in range(len(mask_l[i])) if mask_l[i][t]]
        if not valid_t:
            continue
        seq_log = sum(lp_l[i][t] - old_l[i][t] for t in valid_t) / len(valid_t)
        for t in valid_t:
            a = adv_l[i] if not isinstance(adv_l[i], list) else adv_l[i][t]
            w = math.exp(lp_l[i][t] - old_l[i][t] if level == "token" else seq_log)
            n += 1
            low += (w < 1 - clip_low) and a < 0
            high += (w > 1 + clip_high) and a > 0
    return low, high, n


# --------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------


def clip_kw(level):
    # token ratios spread ~0.3 around 1: 0.2 clips many; sequence ratios are averages
    # of ~5 tokens, so a narrower range is needed to clip some of them.
    return dict(clip_low=0.2, clip_high=0.25) if level == "token" else dict(clip_low=0.04, clip_high=0.05)


# --------------------------------------------------------------------------------------
# loss value and gradient vs the naive reference, every level x mode
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["adv(B)", "adv(B,T)"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_policy_loss_matches_naive_reference(level, mode, per_token_adv):
    lp, old, ref, adv, mask = random_batch(1, per_token_adv=per_token_adv)
    ck = clip_kw(level)
    low, high, _ = naive_clip_counts(lp, old, adv, mask, level=level, **ck)
    assert low > 0 and high > 0, "the test data must exercise both clip branches"

    lp_leaf = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp_leaf, old, adv, mask, importance_sampling=level, loss_agg_mode=mode, **ck)
    loss.backward()

    kw = dict(level=level, mode=mode, **ck)
    expected = naive_policy_loss(lp, old, adv, mask, **kw)
    assert_close(loss, torch.tensor(expected, dtype=DT), rtol=1e-10, atol=1e-12)
    assert_close(lp_leaf.grad, naive_grad(lp, old, adv, mask, **kw), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("level", LEVELS)
def test_policy_loss_with_kl_and_dual_clip_matches_naive(level, estimator):
    lp, old, ref, adv, mask = random_batch(2, spread=0.6, per_token_adv=True)
    ck = clip_kw(level)
    kw = dict(level=level, mode="seq-mean-token-mean", dual_clip=1.3, ref=ref, kl_coef=0.07, kl_estimator=estimator, **ck)
    lp_leaf = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        lp_leaf, old, adv, mask, importance_sampling=level, loss_agg_mode="seq-mean-token-mean", dual_clip=1.3,
        ref_logprobs=ref, kl_coef=0.07, kl_estimator=estimator, **ck,
    )
    loss.backward()
    assert metrics["dual_clip_frac"] > 0, "the test data must exercise the dual clip"
    assert_close(loss, torch.tensor(naive_policy_loss(lp, old, adv, mask, **kw), dtype=DT), rtol=1e-10, atol=1e-12)
    assert_close(lp_leaf.grad, naive_grad(lp, old, adv, mask, **kw), rtol=1e-6, atol=1e-8)


def test_hand_case_seq_sum_token_sum_norm():
    # token level, no clip acting (ratios 1): per-token loss -A; two responses of lengths 2 and
    # 1 with A = 2 and -4, an empty third; H = 4. seq sums -4 and +4 / 4 -> -1 + 1 = 0 summed;
    # with A = 2 and 4: (-4 - 4) / 4 = -2 (not divided by the 2 responses, unlike -mean-)
    lp = torch.zeros(3, 2, dtype=DT)
    mask = make_mask([2, 1, 0], 2)
    for adv, expected, mean_expected in (([2.0, -4.0, 9.0], 0.0, 0.0), ([2.0, 4.0, 9.0], -2.0, -1.0)):
        leaf = lp.clone().requires_grad_(True)
        loss, _ = policy_loss(leaf, lp, torch.tensor(adv, dtype=DT), mask, importance_sampling="token",
                              loss_agg_mode="seq-sum-token-sum-norm", clip_low=0.2, clip_high=0.2, horizon=4)
        loss.backward()
        assert float(loss) == pytest.approx(expected, abs=1e-12)
        # d loss / d lp[i, t] = -A_i * ratio / H on valid tokens (ratio 1)
        assert_close(leaf.grad, torch.tensor([[-adv[0] / 4, -adv[0] / 4], [-adv[1] / 4, 0.0], [0.0, 0.0]], dtype=DT))
        mean, _ = policy_loss(lp, lp, torch.tensor(adv, dtype=DT), mask, importance_sampling="token",
                              loss_agg_mode="seq-mean-token-sum-norm", clip_low=0.2, clip_high=0.2, horizon=4)
        assert float(mean) == pytest.approx(mean_expected, abs=1e-12)


def test_horizon_argument_is_the_denominator_of_sum_norm():
    lp, old, ref, adv, mask = random_batch(3)
    loss, _ = policy_loss(lp, old, adv, mask, importance_sampling="seq", loss_agg_mode="seq-mean-token-sum-norm",
                          clip_low=0.04, clip_high=0.05, horizon=37)
    expected = naive_policy_loss(lp, old, adv, mask, level="seq", mode="seq-mean-token-sum-norm", horizon=37,
                                 clip_low=0.04, clip_high=0.05)
    assert_close(loss, torch.tensor(expected, dtype=DT))


# --------------------------------------------------------------------------------------
# hand-computed small cases
# --------------------------------------------------------------------------------------


def test_hand_case_token_level_clipping():
    # one response, 3 tokens, ratios 1.5, 0.5, 1.1; A = +1, -1, +1; clip 0.2
    lp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1)]], dtype=DT)
    old = torch.zeros_like(lp)
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=DT)
    mask = torch.ones_like(lp)
    loss, _ = policy_loss(lp, old, adv, mask, importance_sampling="token", clip_low=0.2, clip_high=0.2,
                          loss_agg_mode="token-mean")
    # obj: min(1.5, 1.2) = 1.2 ; min(-0.5, -0.8) = -0.8 ; min(1.1, 1.1) = 1.1
    assert_close(loss, torch.tensor(-(1.2 - 0.8 + 1.1) / 3, dtype=DT))


def test_hand_case_sequence_ratio_is_geometric_mean():
    # L = 2, log-ratios log 4 and 0 -> s = exp(log(4)/2) = 2; A = 1; clip wide -> loss = -2
    lp = torch.tensor([[math.log(4.0), -1.0, 7.0]], dtype=DT)
    old = torch.tensor([[0.0, -1.0, -3.0]], dtype=DT)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=DT)
    adv = torch.tensor([1.0], dtype=DT)
    for mode, expected in [("seq-mean-token-mean", -2.0), ("seq-mean-token-sum", -4.0), ("token-mean", -2.0),
                           ("seq-mean-token-sum-norm", -4.0 / 3.0)]:
        loss, m = policy_loss(lp, old, adv, mask, importance_sampling="seq", clip_low=0.5, clip_high=5.0,
                              loss_agg_mode=mode)
        assert_close(loss, torch.tensor(expected, dtype=DT), msg=mode)
    assert_close(m["ratio_mean"], torch.tensor(2.0))
    # the same with clip 0.2: s clipped to 1.2 -> loss -1.2
    loss, m = policy_loss(lp, old, adv, mask, importance_sampling="seq", clip_low=0.2, clip_high=0.2)
    assert_close(loss, torch.tensor(-1.2, dtype=DT))
    assert_close(m["clip_frac_high"], torch.tensor(1.0))


def test_hand_case_dual_clip():
    # token level, clip 0.2, dual clip 3, token-mean over 3 tokens:
    #  t0: w=5, A=-1: min(-5, -1.2) = -5, dual: max(-5, -3) = -3 -> loss 3   (dual active)
    #  t1: w=5, A=+1: min(5, 1.2) = 1.2 (dual never acts for A > 0)        -> loss -1.2
    #  t2: w=2, A=-1: min(-2, -1.2) = -2, max(-2, -3) = -2                   -> loss 2
    lp = torch.tensor([[math.log(5.0), math.log(5.0), math.log(2.0)]], dtype=DT, requires_grad=True)
    old = torch.zeros(1, 3, dtype=DT)
    adv = torch.tensor([[-1.0, 1.0, -1.0]], dtype=DT)
    mask = torch.ones(1, 3, dtype=DT)
    loss, m = policy_loss(lp, old, adv, mask, importance_sampling="token", clip_low=0.2, clip_high=0.2,
                          dual_clip=3.0, loss_agg_mode="token-mean")
    assert_close(loss, torch.tensor((3.0 - 1.2 + 2.0) / 3.0, dtype=DT))
    assert_close(m["dual_clip_frac"], torch.tensor(1.0 / 3.0), check_dtype=False)
    loss.backward()
    # t0 dual-clipped (constant -3), t1 clipped (constant 1.2): no gradient; t2: d(-w A)/dlp /3 = w/3 = 2/3
    assert_close(lp.grad, torch.tensor([[0.0, 0.0, 2.0 / 3.0]], dtype=DT))

    loss_nodual, _ = policy_loss(lp.detach(), old, adv, mask, importance_sampling="token", clip_low=0.2,
                                 clip_high=0.2, loss_agg_mode="token-mean")
    assert_close(loss_nodual, torch.tensor((5.0 - 1.2 + 2.0) / 3.0, dtype=DT))


def test_hand_case_dual_clip_sequence_level():
    # seq level: s = 4 for a response with A = -2; dual 3: min(-8, -2*1.2) = -8 -> max(-8, -6) = -6
    lp = torch.tensor([[math.log(4.0), math.log(4.0)]], dtype=DT)
    old = torch.zeros_like(lp)
    mask = torch.ones_like(lp)
    loss, m = policy_loss(lp, old, torch.tensor([-2.0], dtype=DT), mask, importance_sampling="seq",
                          clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert_close(loss, torch.tensor(6.0, dtype=DT))
    assert_close(m["dual_clip_frac"], torch.tensor(1.0), check_dtype=False)


# --------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------

# lp = [-1, -2], ref = [-1.5, -1]  ->  u = ref - lp = [-0.5, 1.0]
KL_HAND = {
    "k1": [0.5, -1.0],  # -u
    "k2": [0.125, 0.5],  # u^2 / 2
    # exp(u) - u - 1: exp(-0.5) + 0.5 - 1 = 0.6065306597126334 - 0.5 ; e - 2
    "k3": [0.10653065971263342, 0.7182818284590451],
}


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_kl_penalty_by_hand(estimator):
    lp = torch.tensor([-1.0, -2.0], dtype=DT)
    ref = torch.tensor([-1.5, -1.0], dtype=DT)
    assert_close(kl_penalty(lp, ref, estimator), torch.tensor(KL_HAND[estimator], dtype=DT))


def test_kl_penalty_k3_is_finite_and_nonnegative_for_extreme_inputs():
    lp = torch.tensor([0.0, -1000.0, 0.0, -3.0], dtype=DT)
    ref = torch.tensor([-1000.0, 0.0, 0.0, -3.0 + 1e-9], dtype=DT)
    k = kl_penalty(lp, ref, "k3")
    assert torch.isfinite(k).all()
    assert (k >= 0).all()
    assert_close(k[2:], torch.zeros(2, dtype=DT), atol=1e-12, rtol=0)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_kl_term_added_to_loss_by_hand(estimator):
    # ratio 1 everywhere (lp == old) and A = 0: the surrogate is 0, the loss is kl_coef * mean(k)
    lp = torch.tensor([[-1.0, -2.0, 5.0]], dtype=DT)
    ref = torch.tensor([[-1.5, -1.0, 9.0]], dtype=DT)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=DT)
    adv = torch.zeros(1, dtype=DT)
    k = KL_HAND[estimator]
    loss, m = policy_loss(lp, lp.clone(), adv, mask, ref_logprobs=ref, kl_coef=0.1, kl_estimator=estimator,
                          loss_agg_mode="seq-mean-token-mean")
    assert_close(loss, torch.tensor(0.1 * (k[0] + k[1]) / 2, dtype=DT))
    assert_close(m["kl"], torch.tensor((k[0] + k[1]) / 2, dtype=DT), check_dtype=False)
    # with A = 1 and s = 1 (in range): loss = -1 + kl term
    loss, _ = policy_loss(lp, lp.clone(), torch.ones(1, dtype=DT), mask, ref_logprobs=ref, kl_coef=0.1,
                          kl_estimator=estimator, loss_agg_mode="seq-mean-token-sum")
    assert_close(loss, torch.tensor(-2.0 + 0.1 * (k[0] + k[1]), dtype=DT))
    # kl_coef = 0: the reference only feeds the metric
    loss, m = policy_loss(lp, lp.clone(), adv, mask, ref_logprobs=ref, kl_coef=0.0, kl_estimator=estimator)
    assert_close(loss, torch.tensor(0.0, dtype=DT))
    assert "kl" in m


def test_kl_gradient_k3_by_hand():
    # d k3 / d lp = d(exp(ref - lp) - (ref - lp) - 1)/d lp = 1 - exp(ref - lp)
    lp = torch.tensor([[-1.0, -2.0]], dtype=DT, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=DT)
    loss, _ = policy_loss(lp, lp.detach().clone(), torch.zeros(1, dtype=DT), torch.ones(1, 2, dtype=DT),
                          ref_logprobs=ref, kl_coef=0.5, kl_estimator="k3", loss_agg_mode="seq-mean-token-sum")
    loss.backward()
    assert_close(lp.grad, torch.tensor([[0.5 * (1 - math.exp(-0.5)), 0.5 * (1 - math.exp(1.0))]], dtype=DT))


# --------------------------------------------------------------------------------------
# clip-fraction metrics
# --------------------------------------------------------------------------------------


def test_clip_metrics_token_level_by_hand():
    # row 0: ratios 0.5, 1.0, 1.5 with A = -1, -1, +1  -> t0 low, t2 high
    # row 1: ratios 0.5, 1.5, (pad) with A = +1, -1    -> neither (wrong sign for clipping)
    lp = torch.log(torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.5, 9.0]], dtype=DT))
    old = torch.zeros_like(lp)
    adv = torch.tensor([[-1.0, -1.0, 1.0], [1.0, -1.0, 1.0]], dtype=DT)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=DT)
    _, m = policy_loss(lp, old, adv, mask, importance_sampling="token", clip_low=0.2, clip_high=0.2)
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    assert_close(m["clip_frac_low"].float(), f(1 / 5))
    assert_close(m["clip_frac_high"].float(), f(1 / 5))
    assert_close(m["clip_frac"].float(), f(2 / 5))
    assert_close(m["ratio_mean"].float(), f((0.5 + 1.0 + 1.5 + 0.5 + 1.5) / 5))
    assert_close(m["ratio_min"].float(), f(0.5))
    assert_close(m["ratio_max"].float(), f(1.5))


def test_clip_metrics_token_level_low_and_high_are_separate():
    lp = torch.log(torch.tensor([[0.5, 0.6, 0.7, 1.0]], dtype=DT))
    adv = torch.tensor([[-1.0, -1.0, -1.0, 1.0]], dtype=DT)
    _, m = policy_loss(lp, torch.zeros_like(lp), adv, torch.ones_like(lp), importance_sampling="token",
                       clip_low=0.2, clip_high=0.2)
    assert_close(m["clip_frac_low"].float(), torch.tensor(3 / 4))
    assert_close(m["clip_frac_high"].float(), torch.tensor(0.0))


def test_clip_metrics_sequence_level_by_hand():
    # per-response sequence ratios (geometric means):
    #  r0: L=2, log-ratios log(0.25), 0 -> s = 0.5, A = -1  -> low
    #  r1: L=1, log-ratio log(1.5)     -> s = 1.5, A = +1  -> high
    #  r2: L=3, s = 1.5,                A = -1             -> neither
    #  r3: L=0                                               -> not counted
    #  r4: L=3, s = 1.0,                A = +1             -> neither
    # (ratio_mean is over sequences: 1.125; a mean over tokens would be 10/9)
    lp = torch.tensor([
        [math.log(0.25), 0.0, 0.0],
        [math.log(1.5), 4.0, 4.0],
        [math.log(1.5), math.log(1.5), math.log(1.5)],
        [3.0, 3.0, 3.0],
        [math.log(2.0), math.log(0.5), 0.0],
    ], dtype=DT)
    old = torch.zeros_like(lp)
    mask = make_mask([2, 1, 3, 0, 3], 3)
    adv = torch.tensor([-1.0, 1.0, -1.0, 5.0, 1.0], dtype=DT)
    for level in ("seq", "seq-token"):
        _, m = policy_loss(lp, old, adv, mask, importance_sampling=level, clip_low=0.2, clip_high=0.2)
        f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
        assert_close(m["clip_frac_low"].float(), f(1 / 4), msg=level)
        assert_close(m["clip_frac_high"].float(), f(1 / 4), msg=level)
        assert_close(m["clip_frac"].float(), f(2 / 4), msg=level)
        assert_close(m["ratio_mean"].float(), f((0.5 + 1.5 + 1.5 + 1.0) / 4), msg=level)
        assert_close(m["ratio_min"].float(), f(0.5), msg=level)
        assert_close(m["ratio_max"].float(), f(1.5), msg=level)


def test_clip_metrics_match_naive_counts_on_random_data():
    lp, old, ref, adv, mask = random_batch(4, per_token_adv=True)
    low, high, n = naive_clip_counts(lp, old, adv, mask, level="token", clip_low=0.2, clip_high=0.25)
    _, m = policy_loss(lp, old, adv, mask, importance_sampling="token", clip_low=0.2, clip_high=0.25)
    assert_close(m["clip_frac_low"].double(), torch.tensor(low / n, dtype=DT))
    assert_close(m["clip_frac_high"].double(), torch.tensor(high / n, dtype=DT))


# --------------------------------------------------------------------------------------
# gradient of the GSPO objective
# --------------------------------------------------------------------------------------


def test_gspo_gradient_formula_wrt_logprobs():
    lp, old, ref, adv, mask = random_batch(5, spread=0.4)
    lp_l, old_l, adv_l, mask_l = lp.tolist(), old.tolist(), adv.tolist(), mask.tolist()
    lp_leaf = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp_leaf, old, adv, mask, importance_sampling="seq", loss_agg_mode="seq-mean-token-mean",
                          clip_low=1.0, clip_high=1e6)
    loss.backward()
    n = sum(1 for row in mask_l if sum(row) > 0)
    expected = [[0.0] * len(mask_l[0]) for _ in mask_l]
    for i, row in enumerate(mask_l):
        L = int(sum(row))
        if L == 0:
            continue
        s = math.exp(sum(lp_l[i][t] - old_l[i][t] for t in range(len(row)) if row[t]) / L)
        for t in range(len(row)):
            if row[t]:
                expected[i][t] = -(1.0 / n) * s * adv_l[i] * (1.0 / L)
    assert_close(lp_leaf.grad, torch.tensor(expected, dtype=DT), rtol=1e-10, atol=1e-12)


def test_gspo_parameter_gradient_through_tiny_linear_model():
    g = torch.Generator().manual_seed(6)
    B, T, D, V = 4, 5, 3, 6
    lengths = [5, 2, 0, 3]
    mask = make_mask(lengths, T)
    x = torch.randn(B, T, D, generator=g, dtype=DT)
    y = torch.randint(0, V, (B, T), generator=g)
    W = torch.randn(V, D, generator=g, dtype=DT, requires_grad=True)
    adv = torch.tensor([1.3, -0.7, 2.0, -1.1], dtype=DT)
    old = (torch.log_softmax(x @ W.detach().T, -1).gather(-1, y[..., None]).squeeze(-1)
           + torch.randn(B, T, generator=g, dtype=DT) * 0.3)

    lp = torch.log_softmax(x @ W.T, -1).gather(-1, y[..., None]).squeeze(-1)
    loss, _ = policy_loss(lp, old, adv, mask, importance_sampling="seq", loss_agg_mode="seq-mean-token-mean",
                          clip_low=1.0, clip_high=1e6)
    loss.backward()

    # naive: lp[i,t] = W[y] . x - logsumexp(W x); d lp / d W[v] = (1[v == y] - softmax_v) x
    Wl, xl, yl, oldl, ml, al = W.detach().tolist(), x.tolist(), y.tolist(), old.tolist(), mask.tolist(), adv.tolist()
    n = sum(1 for L in lengths if L > 0)
    expected = [[0.0] * D for _ in range(V)]
    for i in range(B):
        L = lengths[i]
        if L == 0:
            continue
        lps, grads = [], []
        for t in range(T):
            if not ml[i][t]:
                continue
            logits = [sum(Wl[v][d] * xl[i][t][d] for d in range(D)) for v in range(V)]
            mx = max(logits)
            z = sum(math.exp(l - mx) for l in logits)
            probs = [math.exp(l - mx) / z for l in logits]
            lps.append(logits[yl[i][t]] - mx - math.log(z))
            grads.append([[((1.0 if v == yl[i][t] else 0.0) - probs[v]) * xl[i][t][d] for d in range(D)]
                          for v in range(V)])
        s = math.exp(sum(lps[k] - oldl[i][t] for k, t in enumerate(t for t in range(T) if ml[i][t])) / L)
        for gr in grads:
            for v in range(V):
                for d in range(D):
                    expected[v][d] += -(1.0 / n) * s * al[i] * (1.0 / L) * gr[v][d]
    assert_close(W.grad, torch.tensor(expected, dtype=DT), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dual_clip", [None, 1.2])
@pytest.mark.parametrize("mode", MODES)
def test_seq_and_seq_token_identical_with_per_response_advantages(mode, dual_clip):
    lp, old, ref, adv, mask = random_batch(10, spread=0.5)
    ck = dict(clip_low=0.04, clip_high=0.05)
    low, high, _ = naive_clip_counts(lp, old, adv, mask, level="seq", **ck)
    assert low > 0 and high > 0
    results = {}
    for level in ("seq", "seq-token"):
        leaf = lp.clone().requires_grad_(True)
        loss, m = policy_loss(leaf, old, adv, mask, importance_sampling=level, loss_agg_mode=mode,
                              dual_clip=dual_clip, **ck)
        loss.backward()
        results[level] = (loss.detach(), leaf.grad, m)
        if dual_clip is not None:
            assert m["dual_clip_frac"] > 0, "the test data must exercise the dual clip"
    assert_close(results["seq"][0], results["seq-token"][0], rtol=1e-12, atol=1e-14)
    assert_close(results["seq"][1], results["seq-token"][1], rtol=1e-10, atol=1e-14)
    for key in ("clip_frac_low", "clip_frac_high", "ratio_mean"):
        assert_close(results["seq"][2][key], results["seq-token"][2][key])


def test_seq_token_gradient_by_hand_with_per_token_advantages():
    # seq-token: d/dlp[t] of -(1/L) sum_t s A_t = -(1/L) s A_t (each token its own advantage),
    # while seq spreads sum_t A_t over all tokens: -(1/L) s (sum_u A_u) / L.
    lp = torch.tensor([[0.1, -0.1, 0.3]], dtype=DT)
    old = torch.zeros_like(lp)
    mask = torch.ones_like(lp)
    adv = torch.tensor([[1.0, -2.0, 0.5]], dtype=DT)
    s = math.exp(0.3 / 3)
    kw = dict(clip_low=1.0, clip_high=1e6, loss_agg_mode="seq-mean-token-mean")
    leaf = lp.clone().requires_grad_(True)
    policy_loss(leaf, old, adv, mask, importance_sampling="seq-token", **kw)[0].backward()
    assert_close(leaf.grad, torch.tensor([[-s * 1.0 / 3, s * 2.0 / 3, -s * 0.5 / 3]], dtype=DT))
    leaf = lp.clone().requires_grad_(True)
    policy_loss(leaf, old, adv, mask, importance_sampling="seq", **kw)[0].backward()
    assert_close(leaf.grad, torch.full((1, 3), -s * (1.0 - 2.0 + 0.5) / 9, dtype=DT))


# --------------------------------------------------------------------------------------
# micro-batch invariance
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["adv(B)", "adv(B,T)"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_micro_batch_invariance(level, mode, per_token_adv):
    lengths = (5, 1, 7, 3, 0, 6, 4, 2)
    T = 8
    lp, old, ref, adv, mask = random_batch(8, lengths=lengths, T=T, per_token_adv=per_token_adv)
    ck = clip_kw(level)
    kw = dict(importance_sampling=level, loss_agg_mode=mode, kl_coef=0.05, kl_estimator="k3", dual_clip=1.5, **ck)

    full = lp.clone().requires_grad_(True)
    loss_full, _ = policy_loss(full, old, adv, mask, ref_logprobs=ref, **kw)
    loss_full.backward()
    naive = naive_policy_loss(lp, old, adv, mask, level=level, mode=mode, ref=ref, kl_coef=0.05,
                              kl_estimator="k3", dual_clip=1.5, **ck)
    assert_close(loss_full, torch.tensor(naive, dtype=DT), rtol=1e-10, atol=1e-12)

    num_seqs = sum(1 for L in lengths if L > 0)
    num_tokens = int(mask.sum().item())
    micro = lp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=DT)
    for lo, hi in [(0, 2), (2, 3), (3, 8)]:  # 3 uneven chunks
        t_max = max(max(lengths[lo:hi]), 1)  # each micro-batch padded to its own length
        sl = (slice(lo, hi), slice(0, t_max))
        a = adv[lo:hi, :t_max] if per_token_adv else adv[lo:hi]
        loss, _ = policy_loss(micro[sl], old[sl], a, mask[sl], ref_logprobs=ref[sl], num_seqs=num_seqs,
                              num_tokens=num_tokens, horizon=T, **kw)
        total = total + loss
    total.backward()
    assert_close(total, loss_full, rtol=1e-12, atol=1e-14)
    assert_close(micro.grad, full.grad, rtol=1e-10, atol=1e-14)


# --------------------------------------------------------------------------------------
# robustness
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_empty_response_adds_nothing_and_is_not_counted(level, mode):
    lp, old, ref, adv, mask = random_batch(9, lengths=(3, 5, 2), T=5)
    ck = clip_kw(level)
    kw = dict(importance_sampling=level, loss_agg_mode=mode, ref_logprobs=ref, kl_coef=0.1, **ck)
    base, _ = policy_loss(lp, old, adv, mask, **kw)
    # same batch with an extra all-masked response holding arbitrary values
    lp2 = torch.cat([lp, torch.full((1, 5), 3.0, dtype=DT)])
    old2 = torch.cat([old, torch.full((1, 5), -7.0, dtype=DT)])
    ref2 = torch.cat([ref, torch.full((1, 5), 2.0, dtype=DT)])
    adv2 = torch.cat([adv, torch.tensor([100.0], dtype=DT)])
    mask2 = torch.cat([mask, torch.zeros(1, 5, dtype=DT)])
    kw["ref_logprobs"] = ref2
    with_empty, m = policy_loss(lp2, old2, adv2, mask2, **kw)
    assert_close(with_empty, base, rtol=1e-12, atol=1e-14)
    naive = naive_policy_loss(lp, old, adv, mask, level=level, mode=mode, ref=ref, kl_coef=0.1, **ck)
    assert_close(with_empty, torch.tensor(naive, dtype=DT))
    if level != "token":  # clip fractions of sequence levels are over the 3 real responses
        n_clipped = m["clip_frac"] * 3
        assert_close(n_clipped, n_clipped.round(), check_dtype=False)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_values_at_masked_positions(level, mode, bad, estimator):
    lp, old, ref, adv, mask = random_batch(10, per_token_adv=True)
    ck = clip_kw(level)
    kw = dict(importance_sampling=level, loss_agg_mode=mode, kl_coef=0.1, kl_estimator=estimator, dual_clip=2.0, **ck)
    clean = lp.clone().requires_grad_(True)
    loss_clean, _ = policy_loss(clean, old, adv, mask, ref_logprobs=ref, **kw)
    loss_clean.backward()

    pad = mask == 0
    dirty_lp = lp.masked_fill(pad, bad).requires_grad_(True)
    loss, metrics = policy_loss(dirty_lp, old.masked_fill(pad, bad), adv.masked_fill(pad, bad), mask,
                                ref_logprobs=ref.masked_fill(pad, bad), **kw)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(dirty_lp.grad).all()
    assert_close(loss, loss_clean)
    assert_close(dirty_lp.grad, clean.grad)
    for k, v in metrics.items():
        assert torch.isfinite(v).all(), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_huge_log_ratios_give_finite_loss_and_gradient(level, mode, sign, dtype):
    mask = make_mask([3, 2, 0], 4).to(dtype)
    old = torch.full((3, 4), -2.0, dtype=dtype)
    lp = (old + sign * 1000.0).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=dtype)
    ref = torch.full((3, 4), -1.0, dtype=dtype)
    for clip in (dict(clip_low=0.2, clip_high=0.2), dict(clip_low=1.0, clip_high=1e9)):
        lp.grad = None
        loss, metrics = policy_loss(lp, old, adv, mask, importance_sampling=level, loss_agg_mode=mode,
                                    ref_logprobs=ref, kl_coef=0.1, kl_estimator="k3", **clip)
        loss.backward()
        assert torch.isfinite(loss), clip
        assert torch.isfinite(lp.grad).all(), clip
        for k, v in metrics.items():
            assert torch.isfinite(v).all(), k


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_all_masked_batch(level, mode):
    lp = torch.full((2, 3), float("nan"), dtype=DT, requires_grad=True)
    old = torch.full((2, 3), float("inf"), dtype=DT)
    mask = torch.zeros(2, 3, dtype=DT)
    loss, metrics = policy_loss(lp, old, torch.ones(2, dtype=DT), mask, importance_sampling=level,
                                loss_agg_mode=mode, ref_logprobs=old, kl_coef=0.1)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad == 0).all()
    for k, v in metrics.items():
        assert torch.isfinite(v).all(), k


def test_bf16_and_float32_inputs_run():
    lp, old, ref, adv, mask = random_batch(11)
    for dtype in (torch.float32, torch.bfloat16):
        leaf = lp.to(dtype).requires_grad_(True)
        loss, _ = policy_loss(leaf, old.to(dtype), adv.to(dtype), mask, clip_low=0.04, clip_high=0.05)
        loss.backward()
        expected = naive_policy_loss(lp, old, adv, mask, level="seq", mode="seq-mean-token-mean",
                                     clip_low=0.04, clip_high=0.05)
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        assert abs(loss.item() - expected) < tol
        assert torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_loss_ignores_garbage_at_masked_positions(mode):
    # aggregate_loss on its own (used by policy_loss): NaN / inf token losses at masked
    # positions must neither reach the value nor the gradient (no 0 * NaN).
    g = torch.Generator().manual_seed(13)
    lengths = [3, 0, 5, 1]
    mask = make_mask(lengths, 5)
    clean = torch.randn(4, 5, generator=g, dtype=DT)
    dirty = clean.masked_fill(mask == 0, float("nan"))
    dirty[1, 0] = float("inf")
    dirty.requires_grad_(True)
    loss = aggregate_loss(dirty, mask, mode, horizon=7)
    loss.backward()
    per_seq = [[(t, clean[i, t].item()) for t in range(lengths[i])] for i in range(4)]
    assert_close(loss, torch.tensor(naive_aggregate(per_seq, mode, horizon=7), dtype=DT))
    assert torch.isfinite(dirty.grad).all()
    assert (dirty.grad[mask == 0] == 0).all()


# --------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------


def _ok_inputs():
    lp, old, ref, adv, mask = random_batch(12, lengths=(2, 3), T=3)
    return lp, old, ref, adv, mask


@pytest.mark.parametrize("kwargs", [
    dict(importance_sampling="sequence"),
    dict(importance_sampling="tok"),
    dict(loss_agg_mode="mean"),
    dict(loss_agg_mode="seq-mean"),
    dict(clip_low=-0.1),
    dict(clip_high=-1e-4),
    dict(dual_clip=1.0),
    dict(dual_clip=0.5),
    dict(dual_clip=-3.0),
], ids=lambda kw: f"{next(iter(kw))}={next(iter(kw.values()))}")
def test_bad_arguments_raise_value_error(kwargs):
    lp, old, ref, adv, mask = _ok_inputs()
    with pytest.raises(ValueError):
        policy_loss(lp, old, adv, mask, **kwargs)


def test_unknown_kl_estimator_raises():
    lp, old, ref, adv, mask = _ok_inputs()
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")
    with pytest.raises(ValueError):
        policy_loss(lp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1, kl_estimator="k4")


@pytest.mark.parametrize("which", ["logprobs", "old_logprobs", "mask"])
def test_shape_mismatch_of_logprobs_raises(which):
    lp, old, ref, adv, mask = _ok_inputs()
    args = dict(logprobs=lp, old_logprobs=old, mask=mask)
    args[which] = args[which][:, :2]
    with pytest.raises(ValueError):
        policy_loss(args["logprobs"], args["old_logprobs"], adv, args["mask"])


@pytest.mark.parametrize("adv_shape", [(3,), (1,), (2, 2), (2, 4), (1, 3)])
def test_shape_mismatch_of_advantages_raises(adv_shape):
    # B = 2 responses, T = 3: advantages must be (2,) or (2, 3). A wrong shape must not be
    # silently broadcast (e.g. one advantage (1,) applied to every response).
    lp, old, ref, adv, mask = _ok_inputs()
    with pytest.raises(ValueError):
        policy_loss(lp, old, torch.ones(adv_shape, dtype=DT), mask)


def test_shape_mismatch_of_ref_logprobs_raises():
    lp, old, ref, adv, mask = _ok_inputs()
    with pytest.raises(ValueError):
        policy_loss(lp, old, adv, mask, ref_logprobs=ref[:, :2], kl_coef=0.1)


def test_masked_sequence_mean_by_hand():
    """GSPO's length normalization, written once: NaN in masked places ignored, empty rows 0."""
    from gspo_lightning.objective.loss import masked_sequence_mean

    values = torch.tensor([[0.3, -0.1, float("nan")], [2.0, float("nan"), float("inf")], [float("nan")] * 3])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # (0.3 - 0.1) / 2 = 0.1; 2.0 / 1; no valid token -> 0
    assert torch.allclose(masked_sequence_mean(values, mask), torch.tensor([0.1, 2.0, 0.0]), atol=1e-7)
    assert masked_sequence_mean(torch.ones(2, 4, dtype=torch.bool), torch.ones(2, 4)).tolist() == [1.0, 1.0]
