"""Where our keys follow ROLL, and where ROLL's meaning is offered as another value:
hand-computed values (docs/algorithm.md, "ROLL's seed keys, here")."""

import math

import pytest
import torch

from gspo_lightning.objective.advantages import rewards_to_advantages
from gspo_lightning.objective.loss import aggregate_loss, policy_loss


def test_roll_sum_norm_sums_over_sequences_ours_averages():
    token_loss = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # sequence sums 3 and 3, H = 4
    assert float(aggregate_loss(token_loss, mask, "seq-sum-token-sum-norm", horizon=4)) == pytest.approx(6 / 4)
    assert float(aggregate_loss(token_loss, mask, "seq-mean-token-sum-norm", horizon=4)) == pytest.approx(6 / 4 / 2)


def test_rewards_are_normalized_then_clipped_as_in_roll():
    rewards = torch.tensor([0.0, 10.0, 20.0, 30.0])
    mask = torch.ones(4, 2, dtype=torch.bool)
    scores, _ = rewards_to_advantages(rewards, mask, 4, adv_estimator="reinforce", reward_norm="group", reward_clip=1.0)
    std = math.sqrt((15**2 + 5**2 + 5**2 + 15**2) / 3)  # unbiased
    expected = [max(-1.0, min(1.0, (r - 15) / (std + 1e-6))) for r in (0, 10, 20, 30)]
    assert scores.tolist() == pytest.approx(expected, abs=1e-6)
    assert expected[0] == -1.0 and expected[1] == pytest.approx(-0.3873, abs=1e-4)  # clip-then-normalize gives -1.5, 0.5


def test_dual_clip_constant_is_a_key_roll_1_plus_2_clip_is_one_value_of_it():
    # token ratio 5, advantage -1, clip 0.2: PPO objective min(-5, -1.2) = -5; dual clip max(-5, -c) = -c
    lp = torch.tensor([[math.log(5.0)]])
    old = torch.zeros(1, 1)
    mask = torch.ones(1, 1)
    adv = torch.tensor([-1.0])
    for c in (3.0, 1 + 2 * 0.2):
        loss, metrics = policy_loss(lp, old, adv, mask, importance_sampling="token", clip_low=0.2, clip_high=0.2,
                                    dual_clip=c, loss_agg_mode="token-mean")
        assert float(loss) == pytest.approx(c) and float(metrics["dual_clip_frac"]) == 1.0
