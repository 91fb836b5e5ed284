"""Dynamic sampling: which groups a step keeps, how rounds are seeded, how rollouts of
different widths merge, and the extra prompt stream's resume. Expected values by hand."""

import torch

from gspo_lightning.data.datamodule import PromptDataModule
from gspo_lightning.rollout.dynamic_sampling import DynamicSampler, groups_with_variance, select_groups
from gspo_lightning.rollout.sampling import round_seed
from gspo_lightning.rollout.worker import Rollout

PAD = 0


def make_rollout(prompt_rows, responses, rewards, group_size, tag):
    """A rollout from explicit left-padded prompts and right-padded responses (lists of ids, 0 = pad)."""
    prompt = torch.tensor(prompt_rows)
    response = torch.tensor(responses)
    response_mask = response != PAD
    n = len(rewards)
    return Rollout(
        input_ids=torch.cat([prompt, response], 1), attention_mask=torch.cat([prompt != PAD, response_mask], 1).long(),
        prompt_width=prompt.shape[1], response_mask=response_mask,
        engine_logprobs=torch.where(response_mask, -response.float(), torch.zeros(())),
        rewards=torch.tensor(rewards, dtype=torch.float32), reward_components={"r": torch.tensor(rewards) * 10},
        truncated=torch.zeros(n, dtype=torch.bool), group_size=group_size, policy_version=0,
        prompts=[f"{tag}{i // group_size}" for i in range(n)], completions=[f"{tag}c{i}" for i in range(n)],
        timings={"time/generate": 1.0},
    )


def test_groups_with_variance_by_hand():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert groups_with_variance(rewards, 2).tolist() == [False, True, False, False]
    assert groups_with_variance(rewards, 4).tolist() == [True, True]


def test_round_seeds_are_fixed_and_differ_from_other_steps():
    assert round_seed(5, 1) == 5 * 1_000_033 + 7919
    seeds = {round_seed(s, k) for s in range(50) for k in range(1, 4)}
    assert len(seeds) == 150 and not seeds & set(range(50))


def test_select_groups_repads_prompts_left_and_responses_right():
    a = make_rollout([[7, 8], [7, 8]], [[1, 2, 0], [3, 0, 0]], [1.0, 0.0], 2, "a")
    b = make_rollout([[0, 0, 9], [0, 0, 9]], [[4], [5]], [0.0, 1.0], 2, "b")
    merged = select_groups([a, b], [(1, 0), (0, 0)], PAD)
    assert merged.prompt_width == 3
    assert merged.input_ids.tolist() == [[0, 0, 9, 4, 0, 0], [0, 0, 9, 5, 0, 0], [0, 7, 8, 1, 2, 0], [0, 7, 8, 3, 0, 0]]
    assert merged.attention_mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0]]
    assert merged.response_mask.tolist() == [[True, False, False], [True, False, False], [True, True, False], [True, False, False]]
    assert merged.engine_logprobs.tolist() == [[-4, 0, 0], [-5, 0, 0], [-1, -2, 0], [-3, 0, 0]]
    assert merged.rewards.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert merged.reward_components["r"].tolist() == [0.0, 10.0, 10.0, 0.0]
    assert merged.prompts == ["b0", "b0", "a0", "a0"] and merged.completions == ["bc0", "bc1", "ac0", "ac1"]
    assert merged.timings == {"time/generate": 2.0}


def test_every_per_row_field_of_a_kept_group_comes_from_its_own_round():
    # two rounds of 2 groups x 2 rows, widths 2 and 3; every per-row field is tagged with
    # (round, row) so a row copied from the wrong round or position shows
    a = make_rollout([[7]] * 4, [[1, 2], [3, 0], [4, 4], [5, 0]], [1.0, 0.0, 0.0, 1.0], 2, "a")
    b = make_rollout([[9]] * 4, [[6, 0, 0], [7, 7, 7], [8, 0, 0], [9, 9, 0]], [0.5, 0.0, 1.0, 0.0], 2, "b")
    a.truncated, b.truncated = torch.tensor([False, True, True, False]), torch.tensor([True, False, False, True])
    a.scored, b.scored = None, torch.tensor([True, False, True, True])  # round 0 scored every row
    a.reward_components = {"r": torch.tensor([100.0, 101.0, 102.0, 103.0])}
    b.reward_components = {"r": torch.tensor([200.0, 201.0, 202.0, 203.0])}
    a.behaviour_trainer_logprobs = torch.tensor([[-0.1, -0.2], [-0.3, 0.0], [-0.4, -0.5], [-0.6, 0.0]])
    b.behaviour_trainer_logprobs = torch.tensor([[-1.1, 0, 0], [-1.2, -1.3, -1.4], [-1.5, 0, 0], [-1.6, -1.7, 0]])
    a.reward_errors, b.reward_errors = 1, 2
    a.reward_stats, b.reward_stats = {"reward/judge/failed": 1.0}, {"reward/judge/failed": 3.0}

    merged = select_groups([a, b], [(0, 1), (1, 0), (1, 1)], PAD)  # a's group 1, then b's groups 0 and 1

    assert merged.completions == ["ac2", "ac3", "bc0", "bc1", "bc2", "bc3"]
    assert merged.rewards.tolist() == [0.0, 1.0, 0.5, 0.0, 1.0, 0.0]
    assert merged.truncated.tolist() == [True, False, True, False, False, True]
    assert merged.scored.tolist() == [True, True, True, False, True, True]
    assert merged.reward_components["r"].tolist() == [102.0, 103.0, 200.0, 201.0, 202.0, 203.0]
    assert merged.engine_logprobs.tolist() == [[-4, -4, 0], [-5, 0, 0], [-6, 0, 0], [-7, -7, -7], [-8, 0, 0], [-9, -9, 0]]
    assert merged.lengths.tolist() == [2, 1, 1, 3, 1, 2]
    assert torch.allclose(merged.behaviour_trainer_logprobs, torch.tensor(
        [[-0.4, -0.5, 0], [-0.6, 0, 0], [-1.1, 0, 0], [-1.2, -1.3, -1.4], [-1.5, 0, 0], [-1.6, -1.7, 0]]))
    assert merged.reward_errors == 3 and merged.reward_stats == {"reward/judge/failed": 4.0}  # every round's failures

    b.behaviour_trainer_logprobs = None  # one round without them: the merged rollout has none
    assert select_groups([a, b], [(0, 1), (1, 0)], PAD).behaviour_trainer_logprobs is None


def test_rounds_of_different_policy_versions_are_refused():
    import pytest

    a = make_rollout([[7]] * 2, [[1], [2]], [1.0, 0.0], 2, "a")
    b = make_rollout([[7]] * 2, [[1], [2]], [1.0, 0.0], 2, "b")
    b.policy_version = 1
    with pytest.raises(ValueError, match="same group size and policy version"):
        select_groups([a, b], [(0, 0), (1, 0)], PAD)


class FakeRounds:
    """Round k returns the rewards listed for it; records the seeds and prompt batches asked for."""

    def __init__(self, rounds, group_size=2):
        self.rounds, self.group_size, self.seeds, self.batches = rounds, group_size, [], []

    def generate(self, batch, seed):
        k = len(self.seeds)
        self.seeds.append(seed)
        self.batches.append(batch["tag"])
        rewards = self.rounds[k]
        groups = len(rewards) // self.group_size
        prompts = [[k + 1]] * len(rewards)
        responses = [[10 * k + g + 1] for g in range(groups) for _ in range(self.group_size)]
        return make_rollout(prompts, responses, rewards, self.group_size, f"r{k}")

    def more_prompts(self):
        return {"tag": f"extra{len(self.batches)}", "prompt_ids": [[1]] * 3}


def test_extra_rounds_until_the_step_is_full_then_surplus_is_dropped():
    # 3 groups of 2. Round 0: only group 1 varies. Round 1: groups 0 and 2 vary -> full (3 kept).
    fake = FakeRounds([[1, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 1]])
    rollout, metrics = DynamicSampler(max_extra_rounds=3).fill(
        {"tag": "main", "prompt_ids": [[1]] * 3}, fake.generate, fake.more_prompts, seed=42, pad_token_id=PAD)
    assert fake.seeds == [42, round_seed(42, 1)] and fake.batches == ["main", "extra1"]
    assert rollout.prompts == ["r01", "r01", "r10", "r10", "r12", "r12"]
    assert rollout.rewards.tolist() == [0, 1, 1, 0, 0, 1]
    assert metrics == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/zero_variance_share": 3 / 6,
                       "dynamic_sampling/groups_generated": 6.0, "dynamic_sampling/groups_dropped": 3.0,
                       "dynamic_sampling/groups_filled": 0.0}


def test_at_the_cap_the_step_is_filled_with_zero_variance_groups():
    # nothing varies except one group of round 1; cap of 1 extra round -> 1 kept + 2 filled from round 0
    fake = FakeRounds([[1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]])
    rollout, metrics = DynamicSampler(max_extra_rounds=1).fill(
        {"tag": "main", "prompt_ids": [[1]] * 3}, fake.generate, fake.more_prompts, seed=3, pad_token_id=PAD)
    assert len(fake.seeds) == 2
    assert rollout.prompts == ["r00", "r00", "r01", "r01", "r11", "r11"]
    assert metrics["dynamic_sampling/groups_filled"] == 2.0 and metrics["dynamic_sampling/rounds"] == 2.0
    assert metrics["dynamic_sampling/zero_variance_share"] == 5 / 6


def test_a_full_first_round_is_the_plain_rollout():
    fake = FakeRounds([[1, 0, 0, 1, 0.5, 0]])
    rollout, metrics = DynamicSampler(max_extra_rounds=2).fill(
        {"tag": "main", "prompt_ids": [[1]] * 3}, fake.generate, fake.more_prompts, seed=3, pad_token_id=PAD)
    assert len(fake.seeds) == 1 and metrics["dynamic_sampling/rounds"] == 1.0
    assert rollout.prompts == ["r00", "r00", "r01", "r01", "r02", "r02"]


def test_extra_prompt_stream_is_its_own_shuffle_and_resumes_exactly(tiny_echo):
    def module():
        data = PromptDataModule(path="builtin:echo", rollout_batch_size=4, prompt_length=8, val_size=0, seed=5)
        data.tokenizer = tiny_echo[1]
        data.setup("fit")
        return data

    first = module()
    drawn = [first.extra_batch()["prompt_text"] for _ in range(4)]
    assert first.state_dict() == {"batches_consumed": 0, "extra_batches_consumed": 4}
    main_stream = [first.train_rows[i]["prompt_text"] for i in next(iter(first.train_dataloader().batch_sampler))]
    assert drawn[0] != main_stream  # another order than the main stream's

    resumed = module()
    saved = module()
    for _ in range(2):
        saved.extra_batch()
    resumed.load_state_dict(saved.state_dict())
    assert [resumed.extra_batch()["prompt_text"] for _ in range(2)] == drawn[2:]


def test_without_an_extra_prompt_stream_the_error_says_what_to_change():
    from types import SimpleNamespace

    import pytest

    from gspo_lightning.rollout.source import rollout_source

    worker = SimpleNamespace(engine=None)
    with pytest.raises(ValueError, match="dynamic_sampling needs the PromptDataModule"):  # e.g. prompts from a plain DataLoader
        rollout_source(worker, lambda: iter(()), torch.device("cpu"), lambda step: step, datamodule=None,
                       dynamic_sampling_rounds=3)
    with pytest.raises(ValueError, match="an unsharded policy"):  # ranks would generate different numbers of rounds
        rollout_source(worker, lambda: iter(()), torch.device("cpu"), lambda step: step,
                       datamodule=SimpleNamespace(extra_batch=lambda: {}), dynamic_sampling_rounds=3, sharded=True)


def test_dynamic_sampling_with_a_non_group_estimator_is_refused():
    """reinforce's baseline is the batch: a zero-variance filler group would train with
    advantage reward - batch mean, not 0."""
    import pytest

    from tests.helpers_fit import make_module

    with pytest.raises(ValueError, match="dynamic_sampling with adv_estimator=reinforce: the zero-variance groups"):
        make_module(dynamic_sampling=True, adv_estimator="reinforce")
