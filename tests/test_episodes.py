"""Multi-turn episodes: the runner's token layout and masks, per-turn advantages, the loss over
the model's own tokens, and whole runs through ``gspo fit`` (token in, token out)."""

from __future__ import annotations

import pytest
import torch

from gspo_lightning.data.tasks.lookup import LookupEnvironment, lookup_answer_reward, lookup_call_reward, make_rows
from gspo_lightning.models.tiny import build_tokenizer, get_spec
from gspo_lightning.episodes.environments import Environment
from gspo_lightning.episodes.messages import StepResult
from gspo_lightning.episodes.multi_turn import MultiTurn
from gspo_lightning.objective.advantages import episode_returns, turn_advantages
from gspo_lightning.objective.loss import policy_loss
from gspo_lightning.rollout.engine import SamplingParams
from gspo_lightning.rollout.episodes import run_episodes
from tests.helpers_episodes import (
    ANSWER, CALL, FIND, GET, GUESS, KEY, REPLY, ROW, USER, ScriptedEngine, logged, lookup_config,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(get_spec("tiny-lookup"))


def runner(tokenizer, **kwargs) -> MultiTurn:
    episodes = MultiTurn(LookupEnvironment(), end_of_turn="", **{"max_turns": 3, **kwargs})
    episodes.start(tokenizer)
    return episodes


def test_an_episode_holds_the_sampled_ids_and_the_reply_rendered_once_with_masks(tokenizer):
    engine = ScriptedEngine([[CALL, GUESS], [ANSWER]])
    batch = run_episodes(runner(tokenizer), engine, ["find c"], [ROW], 2, SamplingParams(max_new_tokens=12), seed=5)

    prompt = [USER, FIND, KEY["c"]]
    assert engine.calls[0] == {"prompts": [prompt], "n": 2, "max_new_tokens": 12, "seed": 5}  # groups sampled as one
    # turn 2 continues the live episode from its exact ids: prompt, sampled turn, the tool's reply
    assert engine.calls[1]["prompts"] == [prompt + CALL[0] + REPLY] and engine.calls[1]["n"] == 1
    assert engine.calls[1]["max_new_tokens"] == 12 - 5 and engine.calls[1]["seed"] != 5

    gen = batch.generation
    assert gen.lengths.tolist() == [7, 2]
    assert gen.completion_ids[0].tolist() == CALL[0] + REPLY + ANSWER[0]
    assert gen.completion_ids[1, :2].tolist() == GUESS[0]
    assert batch.loss_mask[0].tolist() == [True, True, True, False, False, True, True]
    assert batch.loss_mask[1].tolist()[:2] == [True, True] and not batch.loss_mask[1, 2:].any()
    assert batch.turn_of_token[0].tolist() == [0, 0, 0, -1, -1, 1, 1]
    assert torch.allclose(gen.logprobs[0], torch.tensor([-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5]))
    assert not gen.truncated.any()
    assert batch.prompt_ids == [prompt, prompt]
    assert batch.completions[0] == [{"role": "assistant", "content": "get c"}, {"role": "tool", "name": "get", "content": "3"},
                                    {"role": "assistant", "content": "3"}]
    assert batch.completions[1] == [{"role": "assistant", "content": "5"}]
    assert batch.turn_rewards == [[0.0, 0.0], [0.0]]
    stats = batch.stats
    assert stats["episode/turns"] == 1.5 and stats["episode/tool_calls"] == 0.5 and stats["episode/tool_errors"] == 0.0
    assert stats["episode/ended_done"] == 1.0 and stats["episode/ended_budget"] == 0.0
    assert stats["episode/environment_token_frac"] == pytest.approx(2 / 9)
    # the task's rewards read the conversation: the answer only counts after a tool reply
    assert lookup_answer_reward(batch.completions, ["3", "3"]) == [1.0, 0.0]
    assert lookup_call_reward(batch.completions, ["c", "c"]) == [1.0, 0.0]


class AffinityEngine(ScriptedEngine):
    """A scripted engine that routes by key, as StockVLLMEngine across replicas: records the keys."""

    takes_affinity = True

    def generate(self, prompt_ids, n, params, seed, affinity=None):
        generation = super().generate(prompt_ids, n, params, seed)
        self.calls[-1]["affinity"] = affinity
        return generation


def test_every_turn_of_an_episode_goes_to_its_groups_server(tokenizer):
    """Two prompts x 2 episodes; the first group answers at once, the second group's episodes call
    a tool. Their second turns are the 1st and 2nd live prompts, and are keyed by their group (1, 1),
    not by that place (which would split them over two servers): each finds its conversation in
    the server that sampled its first turn."""
    engine = AffinityEngine([[GUESS, GUESS, CALL, CALL], [ANSWER, ANSWER]])
    rows = [ROW, {**ROW, "prompt": "find c "}]
    batch = run_episodes(runner(tokenizer), engine, ["find c", "find c"], rows, 2, SamplingParams(max_new_tokens=12),
                         seed=5)
    assert engine.calls[0]["affinity"] == [0, 1] and engine.calls[0]["n"] == 2  # the groups, in turn
    assert len(engine.calls[1]["prompts"]) == 2 and engine.calls[1]["affinity"] == [1, 1]  # both live episodes are group 1's
    assert batch.generation.lengths.tolist()[:2] == [2, 2]


def test_a_reply_that_does_not_fit_the_budget_is_not_appended_and_the_episode_is_truncated(tokenizer):
    engine = ScriptedEngine([[CALL, GUESS]])
    batch = run_episodes(runner(tokenizer), engine, ["find c"], [ROW], 2, SamplingParams(max_new_tokens=5), seed=0)
    assert len(engine.calls) == 1  # no second turn: 3 sampled + 2 reply tokens leave no room for an answer
    assert batch.generation.lengths.tolist() == [3, 2]
    assert batch.generation.truncated.tolist() == [True, False]
    assert batch.stats["episode/ended_budget"] == 0.5 and batch.stats["episode/ended_done"] == 0.5
    assert batch.completions[0] == [{"role": "assistant", "content": "get c"}]  # the unsent reply is not in it


def test_max_turns_and_max_turn_tokens_end_episodes(tokenizer):
    engine = ScriptedEngine([[CALL, GUESS]])
    batch = run_episodes(runner(tokenizer, max_turns=1), engine, ["find c"], [ROW], 2, SamplingParams(max_new_tokens=12), seed=0)
    assert batch.stats["episode/ended_max_turns"] == 0.5 and not batch.generation.truncated.any()
    assert batch.stats["episode/tool_calls"] == 0.5  # the last turn's call still ran and counted

    long_turn = ([GET, KEY["c"], KEY["d"]], [-0.1, -0.1, -0.1])  # no <eos> within max_turn_tokens
    engine = ScriptedEngine([[long_turn, GUESS]])
    batch = run_episodes(runner(tokenizer, max_turn_tokens=3), engine, ["find c"], [ROW], 2, SamplingParams(max_new_tokens=12), seed=0)
    assert engine.calls[0]["max_new_tokens"] == 3
    assert batch.stats["episode/ended_turn_tokens"] == 0.5 and batch.generation.truncated.tolist() == [True, False]


class RaisingEnvironment(Environment):
    def step(self, assistant_message):
        raise KeyError("no such board")


def test_an_environment_that_raises_stops_the_run_with_its_context_or_ends_the_episode(tokenizer):
    params = SamplingParams(max_new_tokens=12)
    episodes = MultiTurn(RaisingEnvironment(), end_of_turn="")
    episodes.start(tokenizer)
    with pytest.raises(RuntimeError, match=r"RaisingEnvironment raised in step\(\) at turn 1 \(KeyError.*on_environment_error=end"):
        run_episodes(episodes, ScriptedEngine([[CALL]]), ["find c"], [ROW], 1, params, seed=0)
    episodes = MultiTurn(RaisingEnvironment(), end_of_turn="", on_environment_error="end")
    episodes.start(tokenizer)
    batch = run_episodes(episodes, ScriptedEngine([[CALL]]), ["find c"], [ROW], 1, params, seed=0)
    assert batch.stats["episode/ended_environment_error"] == 1.0 and batch.generation.lengths.tolist() == [3]


class RewardingEnvironment(Environment):
    """Turn rewards 0.5 then 0.25, done after two turns."""

    def __init__(self):
        self.turn = 0

    def step(self, assistant_message):
        self.turn += 1
        return StepResult(messages=[{"role": "tool", "content": "1"}], reward=0.5 / self.turn, done=self.turn == 2)


def test_turn_rewards_reach_the_episode(tokenizer):
    episodes = MultiTurn(RewardingEnvironment(), end_of_turn="")
    episodes.start(tokenizer)
    batch = run_episodes(episodes, ScriptedEngine([[CALL], [ANSWER]]), ["find c"], [ROW], 1, SamplingParams(max_new_tokens=12), seed=0)
    assert batch.turn_rewards == [[0.5, 0.25]]


def test_episode_returns_and_per_turn_advantages_by_hand():
    # episode 0: turn rewards 0.5 and 0, outcome 1 -> returns 1.5 (turn 0) and 1.0 (turn 1);
    # episode 1: one turn, no turn reward, outcome 0 -> return 0
    outcome = torch.tensor([1.0, 0.0])
    assert episode_returns(outcome, [[0.5, 0.0], [0.0]]) == [[1.5, 1.0], [0.0]]
    # discount 0.5: G1 = 0 + 1.0 = 1.0, G0 = 0.5 + 0.5 * 1.0 = 1.0
    assert episode_returns(outcome, [[0.5, 0.0], [0.0]], discount=0.5) == [[1.0, 1.0], [0.0]]
    turn_of_token = torch.tensor([[0, 0, -1, 1], [0, -1, -1, -1]])
    adv = turn_advantages(outcome, [[0.5, 0.0], [0.0]], turn_of_token, group_size=2, eps=0.0)
    # group returns G[., 0] = (1.5, 0): mean 0.75, unbiased std 1.0606602
    std = (2 * 0.75 ** 2) ** 0.5
    expected = torch.tensor([[0.75 / std, 0.75 / std, 0.0, 0.25 / std], [-0.75 / std, 0.0, 0.0, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-6)
    # no turn rewards, no discount: every token gets the episode's GRPO advantage
    flat = turn_advantages(torch.tensor([1.0, 0.0]), [[0.0, 0.0], [0.0]], turn_of_token, group_size=2, eps=0.0)
    assert torch.allclose(flat[0, [0, 1, 3]], torch.full((3,), 0.5 / 0.5 ** 0.5)) and flat[0, 2] == 0


def test_environment_tokens_change_nothing_in_the_loss():
    """GSPO over an episode equals GSPO over its model tokens alone: the environment's tokens (here
    with wild log-probs) enter neither the sequence ratio, nor |y_i|, nor the KL."""
    torch.manual_seed(3)
    model = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    logprobs = torch.randn(2, 8) * 0.1 - 1
    old = logprobs + torch.randn(2, 8) * 1e-3
    ref = logprobs + torch.randn(2, 8) * 0.05
    noisy = lambda t: torch.where(model, t, torch.randn(2, 8) * 10)  # noqa: E731
    adv = torch.tensor([0.7, -0.7])
    kwargs = dict(importance_sampling="seq", loss_agg_mode="seq-mean-token-mean", kl_coef=0.1)
    episode, _ = policy_loss(noisy(logprobs), noisy(old), adv, model, ref_logprobs=noisy(ref), **kwargs)
    compact = lambda t: torch.stack([torch.cat([t[0, model[0]], torch.zeros(3)]), t[1, :8]])  # noqa: E731
    compact_mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 5 + [0] * 3], dtype=torch.bool)
    alone, _ = policy_loss(compact(logprobs), compact(old), adv, compact_mask, ref_logprobs=compact(ref), **kwargs)
    assert torch.allclose(episode, alone, atol=1e-7)


def test_episodes_through_gspo_fit_have_no_engine_trainer_gap(tmp_path):
    """The trainer scores exactly the tokens the engine sampled: with the engine's log-probs as the
    old policy, their gap over the model's tokens is float32 noise on multi-turn episodes."""
    from gspo_lightning.cli import main

    main(["fit", "--config", str(lookup_config(tmp_path, old_logprobs="engine")), "--seed_everything", "7"])
    rows = logged(tmp_path)
    assert len(rows) == 2
    for row in rows:
        assert row["engine/logprob_abs_diff"] < 1e-5, row["engine/logprob_abs_diff"]
        assert row["episode/turns"] >= 1 and "episode/tool_calls" in row and "episode/environment_token_frac" in row


def test_lookup_rows_need_the_tool():
    rows = make_rows(200, seed=1)
    assert all(r["prompt"] == f"find {r['key']}" and r["answer"] not in r["prompt"] for r in rows)
    assert len({r["table"] for r in rows}) > 150  # every row its own table: nothing to memorize
