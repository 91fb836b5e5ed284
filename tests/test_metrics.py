"""Per-step rollout metrics: a response no reward function scored has no reward to log."""

from types import SimpleNamespace

import pytest
import torch

from gspo_lightning.training.metrics import StepMetrics, record_rollout


def fake_rollout(rewards, scored, group_size):
    n = len(rewards)
    return SimpleNamespace(
        rewards=torch.tensor(rewards), scored=None if scored is None else torch.tensor(scored),
        group_size=group_size, reward_components={}, lengths=torch.full((n,), 3),
        truncated=torch.zeros(n, dtype=torch.bool), response_mask=torch.ones(n, 3, dtype=torch.bool), reward_errors=0,
        turn_of_token=None, episode_stats={}, reward_stats={"reward/judge/failed": 2.0},  # no episodes
    )


def test_unscored_responses_join_no_reward_metric():
    # groups of 4; the reward composer gives an unscored response total 0 (written here as 0.0 with scored False)
    # A: [1, None, None, 0]   B: [1, 1, None, 1] (all scored equal)   C: [None, 0.5, None, None] (one scored)
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.0, 0.0]
    scored = [True, False, False, True, True, True, False, True, False, True, False, False]
    m = StepMetrics()
    record_rollout(m, fake_rollout(rewards, scored, 4), torch.zeros(12, 3))
    values = m.compute()
    # scored rewards 1, 0, 1, 1, 1, 0.5: mean 4.5 / 6, mean of squares 4.25 / 6
    assert values["reward/mean"] == pytest.approx(0.75)
    assert values["reward/judge/failed"] == 2.0  # a judge's unscored samples: a count, summed over ranks
    assert values["reward/sq_mean"] == pytest.approx(4.25 / 6)
    assert values["reward/unscored_frac"] == pytest.approx(0.5)
    # B (all equal) and C (one scored) teach nothing; A does (counting None as 0 made B look spread)
    assert values["reward/zero_std_groups"] == pytest.approx(2 / 3)


def test_every_response_scored_keeps_the_plain_means():
    m = StepMetrics()
    record_rollout(m, fake_rollout([1.0, 0.0, 0.5, 0.5], None, 2), torch.zeros(4, 3))
    values = m.compute()
    assert values["reward/mean"] == pytest.approx(0.5)
    assert values["reward/sq_mean"] == pytest.approx(0.375)
    assert values["reward/unscored_frac"] == 0.0
    assert values["reward/zero_std_groups"] == pytest.approx(0.5)


def test_a_metric_not_measured_this_step_is_nan_not_its_last_value():
    # Lightning's loggers repeat a key's last logged value in every later row: a step that did not
    # measure it (no weight push before an asynchronous rollout, say) must say so
    m = StepMetrics()
    m.update("time/weight_sync", 0.25)
    m.update("time/step", 1.0)
    assert m.compute() == {"time/weight_sync": 0.25, "time/step": 1.0}
    m.update("time/step", 2.0)
    values = m.compute()
    assert values["time/step"] == 2.0 and values["time/weight_sync"] != values["time/weight_sync"]  # NaN
    m.update("time/weight_sync", 0.5)
    values = m.compute()
    assert values["time/weight_sync"] == 0.5 and values["time/step"] != values["time/step"]


def test_aggregates_live_on_the_device_the_module_moved_to():
    """A float's aggregate is created where the module is (NCCL cannot sync CPU tensors):
    the anchor moves with ``.to``, and every aggregate is created on the anchor's device."""
    m = StepMetrics()
    m.update("a", 1.0)
    m.update("b", torch.tensor(2.0), kind="max")
    assert {agg.device for agg in m.aggregates.values()} == {m.device_anchor.device}
    assert "device_anchor" not in m.state_dict()  # not saved: checkpoints stay as they were
    if torch.cuda.is_available():
        m.to("cuda")
        m.update("c", 3.0)
        assert m.aggregates[m._key("c")].device.type == "cuda"


def test_a_reward_that_gives_one_value_step_after_step_is_named_once():
    from gspo_lightning.training.metrics import ConstantRewardWatch

    watch = ConstantRewardWatch(steps=3)
    nan = float("nan")
    same = {"judge": torch.tensor([0.0, 0.0, nan]), "format": torch.tensor([1.0, 0.0, 1.0])}
    assert watch.update(same) == [] and watch.update(same) == []
    lines = watch.update(same)
    assert len(lines) == 1 and lines[0].startswith("reward 'judge' gave every sample the same score (0 at the last step) "
                                                   "for 3 steps in a row")
    assert watch.update(same) == []  # once
    varied = ConstantRewardWatch(steps=2)
    varied.update({"judge": torch.tensor([1.0, 1.0])})
    varied.update({"judge": torch.tensor([1.0, 0.0])})  # the streak breaks
    assert varied.update({"judge": torch.tensor([1.0, 1.0])}) == []
    assert varied.update({"judge": torch.tensor([nan, nan])}) == []  # nothing scored: neither same nor different
    assert len(varied.update({"judge": torch.tensor([1.0, 1.0])})) == 1


def test_a_run_whose_reward_never_varies_says_so_once(tmp_path):
    from gspo_lightning.rewards import RewardSpec
    from tests.helpers_fit import fit, make_module

    flat = make_module(rewards=[RewardSpec(function="tests.helpers_fit.constant_reward", name="flat"),
                                RewardSpec(function="tests.helpers_fit.reward_by_text", name="varied")])
    flat.constant_rewards.steps = 3
    fit(flat, tmp_path, max_steps=4)
    assert flat.constant_rewards.said == {"flat"}
