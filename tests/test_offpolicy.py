"""Off-policy correction (gspo_lightning/objective/offpolicy.py): weights worked out by hand, and
TRL's ``vllm_importance_sampling_mode`` formulas reproduced from their definition."""

import math
import warnings

import pytest
import torch

from gspo_lightning.objective.loss import policy_loss
from gspo_lightning.objective.offpolicy import OffPolicyCorrection, check_correction, correct, effective_sample_size, log_weights

# two responses: the first has 2 valid tokens, the second 1; garbage at padding
OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
BEHAVIOUR = torch.tensor([[-1.5, -1.0, 9.0], [-0.5, 3.0, float("nan")]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
# o - b on valid tokens: [[0.5, -1.0], [0.0]]


def test_log_weights_per_level_by_hand():
    assert torch.allclose(log_weights(OLD, BEHAVIOUR, MASK, "token"), torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.allclose(log_weights(OLD, BEHAVIOUR, MASK, "seq"), torch.tensor([-0.25, 0.0]))  # mean of 0.5, -1
    assert torch.allclose(log_weights(OLD, BEHAVIOUR, MASK, "seq-product"), torch.tensor([-0.5, 0.0]))  # the sum


def test_token_truncation():
    out = correct(OLD, BEHAVIOUR, MASK, OffPolicyCorrection(level="token", method="truncate", truncate_at=1.5))
    # exp(0.5) = 1.6487 -> 1.5; exp(-1) = 0.3679; exp(0) = 1; padding 0
    assert torch.allclose(out.weights, torch.tensor([[1.5, 0.36787944, 0.0], [1.0, 0.0, 0.0]]))
    m = out.metrics
    assert m["weight_mean"] == pytest.approx((1.6487213 + 0.36787944 + 1.0) / 3)
    assert m["weight_max"] == pytest.approx(1.6487213)
    assert m["bounded_frac"] == pytest.approx(1 / 3)
    # (1.5 + 0.3679 + 1)^2 / (3 * (2.25 + 0.1353 + 1)) = 8.22475 / 10.15601
    assert m["ess"] == pytest.approx(0.809841, rel=1e-5)


def test_token_masking():
    out = correct(OLD, BEHAVIOUR, MASK, OffPolicyCorrection(level="token", method="mask", mask_low=0.5, mask_high=1.5))
    assert torch.equal(out.weights, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))  # 1.65 > 1.5, 0.37 < 0.5
    assert out.metrics["bounded_frac"] == pytest.approx(2 / 3)
    assert out.metrics["ess"] == pytest.approx(1 / 3)  # one unit of three carries everything


def test_sequence_geometric_mean_truncation_and_masking():
    out = correct(OLD, BEHAVIOUR, MASK, OffPolicyCorrection(level="seq", method="truncate", truncate_at=0.9))
    assert torch.allclose(out.weights, torch.tensor([math.exp(-0.25), 0.9]))  # 0.7788 kept, 1 -> 0.9
    assert out.metrics["bounded_frac"] == pytest.approx(0.5)
    masked = correct(OLD, BEHAVIOUR, MASK, OffPolicyCorrection(level="seq", method="mask", mask_low=0.8, mask_high=1.2))
    assert torch.allclose(masked.weights, torch.tensor([0.0, 1.0]))  # 0.7788 < 0.8
    assert masked.metrics["weight_mean"] == pytest.approx((0.7788008 + 1.0) / 2)


def test_geometric_mean_stays_in_range_where_the_product_does_not():
    # 4000 tokens with a 1e-3 mean gap: the product weighs e^4 = 54.6, the geometric mean e^0.001
    old, behaviour, mask = torch.full((1, 4000), -1.0), torch.full((1, 4000), -1.001), torch.ones(1, 4000, dtype=torch.bool)
    seq = correct(old, behaviour, mask, OffPolicyCorrection(level="seq", truncate_at=100.0)).weights
    product = correct(old, behaviour, mask, OffPolicyCorrection(level="seq-product", truncate_at=100.0)).weights
    assert float(seq) == pytest.approx(math.exp(0.001), rel=1e-4)
    assert float(product) == pytest.approx(math.exp(4.0), rel=1e-2)


def test_bypass_computes_metrics_but_no_weights():
    out = correct(OLD, BEHAVIOUR, MASK, OffPolicyCorrection(mode="bypass"))
    assert out.weights is None and out.metrics["weight_max"] == pytest.approx(1.0)


def test_effective_sample_size():
    assert effective_sample_size(torch.tensor([1.0, 1.0, 1.0, 1.0])) == pytest.approx(4.0)
    assert effective_sample_size(torch.tensor([2.0, 0.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([1.0, 3.0])) == pytest.approx(16 / 10)


# TRL (GRPOTrainer, vllm_importance_sampling_mode): diff = (old - sampling) * mask;
# sequence_* modes take exp(sum over tokens); *_truncate clamps at max=cap; *_mask sets
# ratios above cap to 0. Expected values below are worked out from those formulas by hand.
TRL_OLD = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
TRL_SAMPLING = torch.tensor([[-1.6, -1.7], [-2.2, -1.9]])  # diffs [0.6, 0.7], [0.2, -0.1]
TRL_MASK = torch.ones(2, 2, dtype=torch.bool)


def test_matches_trl_token_truncate_and_token_mask():
    cap = 2.0  # exp(0.6) = 1.8221, exp(0.7) = 2.0138, exp(0.2) = 1.2214, exp(-0.1) = 0.9048
    truncate = correct(TRL_OLD, TRL_SAMPLING, TRL_MASK, OffPolicyCorrection(level="token", method="truncate", truncate_at=cap))
    assert torch.allclose(truncate.weights, torch.tensor([[1.8221188, 2.0], [1.2214028, 0.9048374]]))
    # TRL's mask has only an upper bound: mask_low = 0 reproduces it
    mask = correct(TRL_OLD, TRL_SAMPLING, TRL_MASK, OffPolicyCorrection(level="token", method="mask", mask_low=0.0, mask_high=cap))
    assert torch.allclose(mask.weights, torch.tensor([[1.8221188, 0.0], [1.2214028, 0.9048374]]))


def test_matches_trl_sequence_truncate_and_sequence_mask_with_the_product_level():
    cap = 3.0  # sums 1.3 and 0.1: exp(1.3) = 3.6693 > 3, exp(0.1) = 1.1052
    truncate = correct(TRL_OLD, TRL_SAMPLING, TRL_MASK, OffPolicyCorrection(level="seq-product", method="truncate", truncate_at=cap))
    assert torch.allclose(truncate.weights, torch.tensor([3.0, 1.1051709]))
    mask = correct(TRL_OLD, TRL_SAMPLING, TRL_MASK, OffPolicyCorrection(level="seq-product", method="mask", mask_low=0.0, mask_high=cap))
    assert torch.allclose(mask.weights, torch.tensor([0.0, 1.1051709]))
    # GSPO's geometric mean of the same rows: exp(0.65) = 1.9155, exp(0.05) = 1.0513: nothing capped
    seq = correct(TRL_OLD, TRL_SAMPLING, TRL_MASK, OffPolicyCorrection(level="seq", method="truncate", truncate_at=cap))
    assert torch.allclose(seq.weights, torch.tensor([1.9155408, 1.0512711]))


def test_the_weights_multiply_the_surrogate_not_the_kl():
    lp = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]], requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    # ratio 1 everywhere, A = +1: token objective 1, weighted 0.5 and 2 -> mean over sequences of -w = -1.25
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor([1.0, 1.0]), mask, is_weights=torch.tensor([0.5, 2.0]))
    assert float(loss.detach()) == pytest.approx(-1.25)
    loss.backward()
    # d/d lp of -w * exp(mean(lp - old)) / 1 sequence-mean = -w / L / N = -w / 2 / 2
    assert torch.allclose(lp.grad, torch.tensor([[-0.125, -0.125], [-0.5, -0.5]]))
    token_w = torch.tensor([[1.0, 0.0], [3.0, 1.0]])
    loss, _ = policy_loss(lp.detach(), lp.detach(), torch.tensor([1.0, 1.0]), mask, importance_sampling="token",
                          clip_low=0.2, clip_high=0.2, loss_agg_mode="token-mean", is_weights=token_w)
    assert float(loss) == pytest.approx(-(1 + 0 + 3 + 1) / 4)


def test_conflicting_keys_are_named():
    with pytest.raises(ValueError, match="truncate_at must be > 0"):
        OffPolicyCorrection(truncate_at=0.0)
    with pytest.raises(ValueError, match="mask_low / mask_high"):
        OffPolicyCorrection(method="mask", mask_low=2.0, mask_high=1.0)
    assert "set old_logprobs=recompute" in check_correction(OffPolicyCorrection(mode="decoupled"), old_logprobs="engine", importance_sampling="seq")[0]
    assert "set old_logprobs=engine" in check_correction(OffPolicyCorrection(mode="bypass"), old_logprobs="recompute", importance_sampling="seq")[0]
    with pytest.warns(UserWarning, match="importance_sampling=token"):
        assert check_correction(OffPolicyCorrection(level="seq"), old_logprobs="recompute", importance_sampling="token") == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_correction(OffPolicyCorrection(level="token"), old_logprobs="recompute", importance_sampling="token") == []
        assert check_correction(None, old_logprobs="engine", importance_sampling="token") == []


def test_metrics_cover_the_whole_batch_over_ranks_not_a_mean_of_per_rank_values():
    """Two ranks: weights [1, 1] on one, [3] on the other. Over the batch the ESS is
    (1 + 1 + 3)^2 / (3 * (1 + 1 + 9)) = 25/33 and the mean weight 5/3; each rank alone has
    an ESS of 1 (a mean of per-rank values would say 1). ``reduce_sum`` stands for the
    all-reduce: it adds the other rank's (sum w, sum w^2, n)."""
    from gspo_lightning.objective.offpolicy import importance_weights
    from gspo_lightning.training.metrics import StepMetrics

    correction = OffPolicyCorrection(level="token", method="truncate", truncate_at=5.0)
    rank_a = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool))  # w = 1, 1
    rank_b = (torch.full((1, 1), math.log(3.0)), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool))  # w = 3
    sums_a, sums_b = torch.tensor([2.0, 2.0, 2.0], dtype=torch.float64), torch.tensor([3.0, 9.0, 1.0], dtype=torch.float64)
    assert correct(*rank_a, correction).metrics["ess"] == pytest.approx(1.0)  # one rank alone
    metrics = StepMetrics()
    importance_weights(*rank_a, correction, metrics, reduce_sum=lambda t: t + sums_b)
    importance_weights(*rank_b, correction, metrics, reduce_sum=lambda t: t + sums_a)
    values = metrics.compute()
    assert values["off_policy/ess"] == pytest.approx(25 / 33)
    assert values["off_policy/weight_mean"] == pytest.approx(5 / 3)
    assert values["off_policy/weight_max"] == pytest.approx(3.0)
