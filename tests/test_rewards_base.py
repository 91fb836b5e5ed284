import math

import pytest

from gspo_lightning.rewards import RewardComposer, RewardError, RewardSpec


def always(value):
    def fn(prompts, completions, **columns):
        return [value] * len(completions)
    return fn


def raises(prompts, completions, **columns):
    raise KeyError("answer")


def too_few(prompts, completions, **columns):
    return [1.0]


def nan_second(prompts, completions, **columns):
    return [1.0, math.nan] + [0.0] * (len(completions) - 2)


def length_of(prompts, completions, scale=1.0, **columns):
    return [scale * len(c) for c in completions]


P, C = ["p1", "p2", "p3"], ["a", "bb", "ccc"]


def test_weighted_sum_by_import_path_with_kwargs():
    composer = RewardComposer([
        RewardSpec(function="tests.test_rewards_base.length_of", weight=2.0, kwargs={"scale": 0.5}),
        RewardSpec(function="tests.test_rewards_base:length_of", weight=-1.0, name="raw_length"),
    ])
    total, parts = composer(P, C, {})
    assert parts == {"length_of": [0.5, 1.0, 1.5], "raw_length": [1.0, 2.0, 3.0]}
    assert total == [2 * 0.5 - 1.0, 2 * 1.0 - 2.0, 2 * 1.5 - 3.0]


def test_columns_reach_the_function():
    seen = {}

    def record(prompts, completions, answer, **columns):
        seen.update(answer=answer, extra=sorted(columns))
        return [0.0] * len(completions)

    RewardComposer([record])(P, C, {"answer": ["1", "2", "3"], "completion_lengths": [1, 2, 3]})
    assert seen == {"answer": ["1", "2", "3"], "extra": ["completion_lengths"]}


@pytest.mark.parametrize("fn, message", [
    (raises, "raised KeyError"),
    (too_few, "returned 1 scores for 3 completions"),
    (nan_second, "returned nan for sample 1"),
])
def test_failures_stop_the_run_naming_function_and_sample(fn, message):
    with pytest.raises(RewardError, match=message) as err:
        RewardComposer([fn])(P, C, {})
    assert repr(fn.__name__) in str(err.value)
    assert "on_reward_error=zero" in str(err.value)


def test_zero_mode_scores_failures_zero_and_counts_them():
    composer = RewardComposer([raises, nan_second, always(1.0)], on_error="zero")
    total, parts = composer(P, C, {})
    assert parts["raises"] == [0.0, 0.0, 0.0]
    assert parts["nan_second"] == [1.0, 0.0, 0.0]
    assert total == [2.0, 1.0, 1.0]
    assert composer.error_counts == {"raises": 3, "nan_second": 1, "fn": 0}


def test_bad_specs_are_clear():
    with pytest.raises(ValueError, match="no reward functions"):
        RewardComposer([])
    with pytest.raises(ValueError, match="cannot import module"):
        RewardComposer([RewardSpec(function="no_such_module.fn")])
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        RewardComposer([RewardSpec(function="gspo_lightning.rewards.nope")])
    with pytest.raises(ValueError, match="unique"):
        RewardComposer([always(1.0), always(2.0)])
