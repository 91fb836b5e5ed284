import asyncio
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


def score(composer, prompts=P, completions=C, completion_ids=None, columns=None):
    return composer(prompts=prompts, completions=completions, completion_ids=completion_ids, columns=columns or {})


def test_weighted_sum_by_import_path_with_kwargs():
    composer = RewardComposer([
        RewardSpec(function="tests.test_rewards_base.length_of", weight=2.0, kwargs={"scale": 0.5}),
        RewardSpec(function="tests.test_rewards_base:length_of", weight=-1.0, name="raw_length"),
    ])
    total, parts, scored = score(composer)
    assert parts == {"length_of": [0.5, 1.0, 1.5], "raw_length": [1.0, 2.0, 3.0]}
    assert total == [2 * 0.5 - 1.0, 2 * 1.0 - 2.0, 2 * 1.5 - 3.0]
    assert scored == [True, True, True]


def test_columns_completion_ids_and_lengths_reach_the_function_by_keyword():
    seen = {}

    def record(*, prompts, completions, completion_ids, answer, **columns):  # keyword-only: no positional call
        seen.update(prompts=prompts, answer=answer, ids=completion_ids, extra=sorted(columns))
        return [0.0] * len(completions)

    score(RewardComposer([record]), completion_ids=[[5], [6, 7], [8, 9, 10]], columns={"answer": ["1", "2", "3"]})
    assert seen == {"prompts": P, "answer": ["1", "2", "3"], "ids": [[5], [6, 7], [8, 9, 10]], "extra": ["completion_lengths"]}


@pytest.mark.parametrize("fn, message", [
    (raises, "raised KeyError"),
    (too_few, "returned 1 scores for 3 completions"),
    (nan_second, "returned nan for sample 1"),
])
def test_failures_stop_the_run_naming_function_and_sample(fn, message):
    with pytest.raises(RewardError, match=message) as err:
        score(RewardComposer([fn]))
    assert repr(fn.__name__) in str(err.value)
    assert "on_reward_error=zero" in str(err.value)


def test_zero_mode_scores_failures_zero_and_counts_them():
    composer = RewardComposer([raises, nan_second, always(1.0)], on_error="zero")
    total, parts, _ = score(composer)
    assert parts["raises"] == [0.0, 0.0, 0.0]
    assert parts["nan_second"] == [1.0, 0.0, 0.0]
    assert total == [2.0, 1.0, 1.0]
    assert composer.error_counts == {"raises": 3, "nan_second": 1, "fn": 0}


def test_none_means_no_score_not_an_error():
    def first_unscored(prompts, completions, **columns):
        return [None, 1.0, 0.5]

    def only_last(prompts, completions, **columns):
        return [None, None, 2.0]

    composer = RewardComposer([first_unscored, only_last])
    total, parts, scored = score(composer)
    assert total == [0.0, 1.0, 2.5]  # weighted sum over the functions that scored the row
    assert scored == [False, True, True]  # row 0: no score at all -> advantage 0 downstream
    assert math.isnan(parts["first_unscored"][0]) and parts["first_unscored"][1:] == [1.0, 0.5]
    assert composer.error_counts == {"first_unscored": 0, "only_last": 0}


def test_async_functions_are_awaited_together():
    running = {"now": 0, "most": 0}

    async def slow_length(prompts, completions, **columns):
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        await asyncio.sleep(0.01)
        running["now"] -= 1
        return [float(len(c)) for c in completions]

    async def other(prompts, completions, **columns):
        return await slow_length(prompts=prompts, completions=completions)

    total, parts, _ = score(RewardComposer([slow_length, other]))
    assert parts["slow_length"] == [1.0, 2.0, 3.0] and total == [2.0, 4.0, 6.0]
    assert running["most"] == 2  # concurrently, as TRL gathers them


def test_async_function_failure_is_reported_like_a_sync_one():
    async def broken(prompts, completions, **columns):
        raise ValueError("no answer column")

    with pytest.raises(RewardError, match="'broken': raised ValueError: no answer column"):
        score(RewardComposer([broken]))


def test_bad_specs_are_clear():
    with pytest.raises(ValueError, match="no reward functions"):
        RewardComposer([])
    with pytest.raises(ValueError, match="cannot import module .* working directory"):
        RewardComposer([RewardSpec(function="no_such_module.fn")])
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        RewardComposer([RewardSpec(function="gspo_lightning.rewards.nope")])
    with pytest.raises(ValueError, match="unique"):
        RewardComposer([always(1.0), always(2.0)])


def test_a_module_path_of_0_1_is_answered_with_the_new_one():
    """0.1's paths no longer import: the error says, in one line, what to write instead."""
    import sys

    with pytest.raises(ValueError) as error:
        RewardComposer([RewardSpec(function="gspo_lightning.tasks.successor.successor_reward")])
    assert "gspo_lightning.tasks.successor moved to gspo_lightning.data.tasks.successor: write that in the config" \
        in str(error.value) and "\n" not in str(error.value)
    assert "gspo_lightning.tasks" not in sys.modules
    from gspo_lightning.data.tasks.successor import successor_reward

    assert RewardComposer([RewardSpec(function="gspo_lightning.data.tasks.successor.successor_reward")]).functions[0][2] \
        is successor_reward


def test_a_column_named_like_an_argument_is_a_clear_error():
    with pytest.raises(ValueError, match=r"\['completions'\] clash"):
        score(RewardComposer([always(1.0)]), columns={"completions": C})


# --- TRL's reward functions, unchanged -------------------------------------------------
# Copies of trl.rewards signatures (trl 1.16), used when TRL is not installed; with TRL
# installed the same tests also run TRL's own functions.

def copy_accuracy_reward(completions, solution, log_extra=None, **kwargs):
    """trl.rewards.accuracy_reward's signature and input handling; a string check of the
    boxed answer stands in for math_verify, and None for an unparseable gold answer."""
    contents = [completion[0]["content"] for completion in completions]
    return [None if not sol.strip() else float(f"\\boxed{{{sol}}}" in content) for content, sol in zip(contents, solution)]


def copy_think_format_reward(completions, **kwargs):
    return [1.0 if completion[0]["content"].startswith("<think>") else 0.0 for completion in completions]


def copy_get_soft_overlong_punishment(max_completion_len, soft_punish_cache):
    def soft_overlong_punishment_reward(completion_ids, **kwargs):
        limit = max_completion_len - soft_punish_cache
        return [0.0 if len(ids) <= limit else max(-1.0, (limit - len(ids)) / soft_punish_cache) for ids in completion_ids]
    return soft_overlong_punishment_reward


def trl_sources():
    sources = [pytest.param("tests.test_rewards_base:copy_", id="signature-copies")]
    try:
        import trl.rewards  # noqa: F401
        import math_verify  # noqa: F401
    except ImportError:
        return sources
    return sources + [pytest.param("trl.rewards:", id="trl")]


CONVERSATION = [[{"role": "user", "content": "What is 1 + 2?"}]] * 3
TRL_COMPLETIONS = [r"<think>add</think> \boxed{3}", r"\boxed{4}", r"\boxed{3}"]


@pytest.mark.parametrize("source", trl_sources())
def test_trl_accuracy_reward_on_a_conversational_dataset(source):
    composer = RewardComposer([RewardSpec(function=source + "accuracy_reward", name="accuracy"),
                               RewardSpec(function=source + "think_format_reward", weight=0.5, name="think")])
    total, parts, scored = score(composer, prompts=CONVERSATION, completions=TRL_COMPLETIONS,
                                 completion_ids=[[1, 2], [3], [4]], columns={"solution": ["3", "3", "3"]})
    assert parts["accuracy"] == [1.0, 0.0, 1.0] and parts["think"] == [1.0, 0.0, 0.0]
    assert total == [1.5, 0.0, 1.0] and scored == [True] * 3


@pytest.mark.parametrize("source", trl_sources())
def test_trl_none_for_an_unparseable_solution_skips_the_row(source):
    composer = RewardComposer([RewardSpec(function=source + "accuracy_reward", name="accuracy_reward")])
    total, parts, scored = score(composer, prompts=CONVERSATION, completions=TRL_COMPLETIONS,
                                 completion_ids=[[1], [2], [3]], columns={"solution": ["3", "", "3"]})
    assert scored == [True, False, True] and total == [1.0, 0.0, 1.0]
    assert math.isnan(parts["accuracy_reward"][1])


@pytest.mark.parametrize("source", trl_sources())
def test_trl_factory_reward_on_completion_ids(source):
    composer = RewardComposer([RewardSpec(function=source + "get_soft_overlong_punishment", factory=True,
                                          kwargs={"max_completion_len": 10, "soft_punish_cache": 4},
                                          name="overlong")])
    total, _, _ = score(composer, completion_ids=[[0] * 5, [0] * 8, [0] * 12])
    assert total == [0.0, -0.5, -1.0]


def judge_scoring_the_first(completions, **_):
    return [1.0] + [None] * (len(completions) - 1)


def truth_scoring_all(completions, **_):
    return [1.0] + [0.0] * (len(completions) - 1)


def test_a_weight_zero_monitor_does_not_score_what_the_trained_functions_left_unscored():
    """reward/truth beside a judge (docs/rewards.md): where the judge gave no score, the monitor's
    score must not turn the sample into a trained 0."""
    composer = RewardComposer([
        RewardSpec(function="tests.test_rewards_base.judge_scoring_the_first", name="judge"),
        RewardSpec(function="tests.test_rewards_base.truth_scoring_all", name="truth", weight=0.0),
    ])
    total, parts, scored = composer(prompts=["p", "p"], completions=["a", "b"], completion_ids=None, columns={})
    assert scored == [True, False] and total == [1.0, 0.0]
    assert parts["truth"] == [1.0, 0.0]  # still logged
