"""Scoring groups as they end, while the others still generate (rollout/scoring.py)."""

import asyncio

import pytest

from gspo_lightning.rewards import LLMJudge, RewardComposer
from gspo_lightning.rollout.engine import SamplingParams
from gspo_lightning.rollout.scoring import GroupScorer, RewardLoop
from tests.helpers_engine import make_engine
from tests.helpers_judge import JudgeServer


@pytest.mark.parametrize("generation_batch_size", [None, 12])  # one batch; chunks of 3 groups (indices run on)
def test_each_group_is_reported_once_as_its_last_response_ends_with_its_final_tokens(tiny_echo, monkeypatch,
                                                                                     generation_batch_size):
    """Random weights, a 40-token cap: responses end at different tokens. Every group is reported
    once, with the token ids the finished generation holds, and groups whose responses all end
    early are reported while the decoding goes on."""
    import gspo_lightning.rollout.hf as hf

    engine, tok = make_engine(tiny_echo, generation_batch_size=generation_batch_size)
    tokens = []  # one entry per sampled token position (a decode step of the current chunk)
    sample = hf._sample_step
    monkeypatch.setattr(hf, "_sample_step", lambda *a: (tokens.append(1), sample(*a))[1])
    reports = []
    prompts = [tok("repeat 3 4", add_special_tokens=False).input_ids] * 8
    generation = engine.generate(prompts, 4, SamplingParams(max_new_tokens=40, temperature=1.5), seed=5,
                                 on_group=lambda index, completions: reports.append((index, completions, len(tokens))))
    assert sorted(index for index, _, _ in reports) == list(range(8))
    rows = [row[:n] for row, n in zip(generation.completion_ids.tolist(), generation.lengths.tolist())]
    for index, completions, _ in reports:
        assert completions == rows[index * 4:(index + 1) * 4]
    if generation_batch_size is None:  # one decode loop: some groups before its last token
        assert any(at < len(tokens) for _, _, at in reports), "no group ended before the others"
        for _, completions, at in reports:  # a group is reported at the token its last response ended on
            assert at == len(tokens) or at == max(map(len, completions))


async def slow_length(prompts, completions, **columns):
    """Waits like a judge, then scores by length (varies within groups)."""
    await asyncio.sleep(0.05)
    return [float(len(c)) for c in completions]


def plain_count(prompts, completions, **columns):
    return [float(c.count("3")) for c in completions]


def test_group_by_group_scoring_gives_the_batch_scores(tiny_echo):
    composer = RewardComposer([slow_length, plain_count])
    prompts = ["repeat 1", "repeat 2", "repeat 3"]
    columns = {"answer": ["1", "2", "3"]}
    completion_ids = [[4, 5, 1], [6], [7, 7], [8, 9, 9, 1], [5], [4, 4, 4]]  # 3 groups of 2
    _, tok = tiny_echo
    decode = lambda ids: tok.batch_decode(ids, skip_special_tokens=True)  # noqa: E731
    loop = RewardLoop()
    try:
        scorer = GroupScorer(composer, loop, decode, prompts, columns, group_size=2)
        for group in (2, 0, 1):  # in the order they end
            scorer.submit(group, completion_ids[group * 2:(group + 1) * 2])
        total, components, scored, completions = scorer.results()
    finally:
        loop.close()
    expected = composer(prompts=[p for p in prompts for _ in range(2)], completions=decode(completion_ids),
                        completion_ids=completion_ids, columns={"answer": ["1", "1", "2", "2", "3", "3"]})
    assert (total, components, scored) == expected and completions == decode(completion_ids)


def test_groups_scored_at_once_share_the_judges_max_concurrency_and_its_connections(monkeypatch):
    with JudgeServer() as server:
        monkeypatch.setenv("JUDGE_KEY", server.key)
        judge = LLMJudge(server.url, "judge", "{completion}", api_key_env="JUDGE_KEY", max_concurrency=3)
        composer = RewardComposer([judge])
        loop = RewardLoop()
        try:
            for _ in range(2):  # two steps on the worker's loop: the judge's connections are kept
                scorer = GroupScorer(composer, loop, lambda ids: ["SLEEP=0.1 SCORE=1"] * len(ids), ["p"] * 4, {},
                                     group_size=4)
                for group in range(4):
                    scorer.submit(group, [[1]] * 4)
                total, _, _, _ = scorer.results()
                assert total == [1.0] * 16
        finally:
            loop.close()
    assert server.max_in_flight == 3 and len(server.requests) == 32
    assert len(server.client_ports) <= 3  # 32 requests over the 3 connections the cap allows, none opened again
    assert judge._session.closed  # closed with the loop


def test_a_step_with_a_waiting_reward_scores_the_same_either_way(tmp_path):
    """Two steps with an async reward, scored group by group or after the generation: the same
    logged rewards (the scores do not depend on when they were computed)."""
    from gspo_lightning.rewards import RewardSpec
    from tests.helpers_fit import fit, make_module

    logged = {}
    for stream in (True, False):
        module = make_module(rewards=[RewardSpec(function="tests.test_scoring.slow_length")], response_length=8,
                             score_while_generating=stream)
        trainer = fit(module, tmp_path / str(stream), max_steps=2)
        assert module.worker.stream_scoring is stream
        logged[stream] = {k: float(v) for k, v in trainer.logged_metrics.items() if k.startswith(("reward/", "loss/"))}
    assert logged[True] == logged[False] and "reward/slow_length" in logged[True]


def test_an_engine_whose_generate_takes_no_on_group_is_scored_after_its_generation(tiny_echo):
    """A subclass that overrides generate with the base signature (a user's engine): no group
    reports are asked of it; an async reward is scored after the generation, as before."""
    from gspo_lightning.rollout.hf import HFEngine
    from gspo_lightning.rollout.scoring import streams

    class OwnEngine(HFEngine):
        def generate(self, prompt_ids, n, params, seed):
            return super().generate(prompt_ids, n, params, seed)

    composer = RewardComposer([slow_length])
    assert streams(HFEngine(), composer) and not streams(OwnEngine(), composer)
    assert not streams(HFEngine(), RewardComposer([plain_count]))  # nothing waits: nothing to overlap
