"""The LLM judge (rewards/judge.py) against a real HTTP endpoint on 127.0.0.1 (tests/helpers_judge.py)."""

import asyncio
import socket
import time

import pytest

from gspo_lightning.errors import ConfigError
from gspo_lightning.rewards import LLMJudge, RewardComposer, RewardSpec, RewardUnavailable
from tests.helpers_judge import JudgeServer


@pytest.fixture
def server(monkeypatch):
    with JudgeServer() as running:
        monkeypatch.setenv("JUDGE_KEY", running.key)
        yield running


def make(server, prompt="Q: {prompt} A: {completion}", **kwargs):
    return LLMJudge(server.url, "judge", prompt, api_key_env="JUDGE_KEY", **kwargs)


def score(judge, completions, prompts=None, **columns):
    return asyncio.run(judge(prompts=prompts or ["p"] * len(completions), completions=completions, **columns))


def test_the_template_sees_prompt_completion_and_columns_and_the_scale_maps_scores(server):
    judge = make(server, "Q: {prompt} | A: {completion} | ref: {answer}", scale=[0, 10], temperature=0.3, max_tokens=7)
    prompts = [[{"role": "user", "content": "two plus two"}], "three"]
    got = score(judge, ["SCORE=8", [{"role": "assistant", "content": "SCORE=2.5"}]], prompts=prompts, answer=["4", "3"])
    assert got == [0.8, 0.25]
    sent = sorted((r["messages"][0]["content"] for r in server.requests), key=len)
    assert sent == ["Q: three | A: SCORE=2.5 | ref: 3", "Q: two plus two | A: SCORE=8 | ref: 4"]
    assert {(r["model"], r["temperature"], r["max_tokens"]) for r in server.requests} == {("judge", 0.3, 7)}


def test_an_episode_is_judged_as_its_conversation():
    episode = [{"role": "assistant", "content": "get a"}, {"role": "tool", "content": "7"},
               {"role": "assistant", "content": "7"}]
    from gspo_lightning.rewards.judge import render_text

    assert render_text(episode) == "assistant: get a\ntool: 7\nassistant: 7"


def test_requests_in_flight_never_exceed_max_concurrency(server):
    judge = make(server, max_concurrency=3)
    got = score(judge, ["SLEEP=0.2 SCORE=1"] * 12)
    assert got == [1.0] * 12
    assert server.max_in_flight == 3  # reached, never passed


def test_timeouts_and_garbage_are_counted_nones_within_the_time_bound(server, capsys):
    judge = make(server, timeout_s=0.3, max_retries=1)
    start = time.perf_counter()
    got = score(judge, ["SLEEP=3", "GARBAGE", "SCORE=3", "SCORE=4", "SCORE=5"])
    elapsed = time.perf_counter() - start
    assert got == [None, None, 3.0, 4.0, 5.0]
    assert elapsed < 2 * 0.3 + 0.5 + 1.0  # two tries of 0.3 s, the 0.5 s back-off, slack: never the 3 s
    assert judge.pop_failures().count == 2 and judge.pop_failures().count == 0
    err = capsys.readouterr().err
    assert "timeout: no reply within timeout_s=0.3 (2 tries)" in err and "no score: none in the reply" in err
    score(judge, ["GARBAGE", "SCORE=1", "SCORE=1"])  # a kind already printed is only counted
    assert capsys.readouterr().err == "" and judge.pop_failures().count == 1


def test_a_retried_status_recovers_and_a_client_error_is_not_retried(server):
    judge = make(server, max_retries=2)
    assert score(judge, ["FLAKY SCORE=6", "STATUS=400"]) == [6.0, None]
    flaky = [r for r in server.requests if "FLAKY" in r["messages"][0]["content"]]
    bad = [r for r in server.requests if "STATUS=400" in r["messages"][0]["content"]]
    assert (len(flaky), len(bad)) == (2, 1)


def test_a_huge_reply_and_a_redirect_are_failures_and_the_key_goes_nowhere_else(server, capsys):
    judge = make(server, max_retries=0)
    assert score(judge, ["HUGE", "REDIRECT", "SCORE=2", "SCORE=3"]) == [None, None, 2.0, 3.0]
    assert server.redirected_keys == []  # not followed: the key was sent to base_url only
    err = capsys.readouterr().err
    assert "bad reply: longer than 1 MiB" in err and "HTTP 307" in err


def test_most_of_a_batch_failing_stops_the_run_naming_the_endpoint_whatever_on_reward_error(server):
    composer = RewardComposer([make(server, max_retries=0)], on_error="zero")
    total, _, scored = composer(prompts=["p"] * 3, completions=["STATUS=500", "STATUS=500", "SCORE=1"],
                                completion_ids=None, columns={})
    assert scored == [False, False, True]  # unscored, not zeroed
    with pytest.raises(RewardUnavailable, match=rf"'LLMJudge' \(LLM judge at {server.url}\) left 2 of 3 samples "
                                                rf"unscored \(the last: HTTP 500"):
        composer.pop_failure_counts(3)  # the rollout's check, after its last group


def test_failures_reach_the_composers_counts_and_unscored_samples_are_not_zeros(server):
    spec = RewardSpec(function="gspo_lightning.rewards.LLMJudge", factory=True, name="judge",
                      kwargs={"base_url": server.url, "model": "judge", "prompt": "{completion}", "api_key_env": "JUDGE_KEY"})
    composer = RewardComposer([spec, lambda completions, **_: [0.5] * len(completions)])
    total, parts, scored = composer(prompts=["p"] * 3, completions=["SCORE=1", "GARBAGE", "SCORE=0"],
                                    completion_ids=None, columns={})
    assert total == [1.5, 0.5, 0.5] and scored == [True, True, True]
    assert parts["judge"][0] == 1.0 and parts["judge"][1] != parts["judge"][1]  # NaN: unscored, not 0
    assert composer.pop_failure_counts(3) == {"reward/judge/failed": 1.0}
    assert composer.pop_failure_counts(3) == {"reward/judge/failed": 0.0}


def test_group_mode_sends_each_group_once_and_reads_one_score_per_response(server):
    judge = make(server, "Rank the answers to {prompt}:\n{completions}", group=True, scale=[0, 10])
    prompts = ["first"] * 3 + ["second"] * 3
    completions = ["a SCORES=10,5,0", "b", "c", "d SCORES=1,2", "e", "f"]
    got = score(judge, completions, prompts=prompts)
    assert got[:3] == [1.0, 0.5, 0.0]
    assert got[3:] == [None] * 3  # two scores for three responses: the whole group unscored
    assert len(server.requests) == 2
    assert server.requests[0]["messages"][0]["content"] == \
        "Rank the answers to first:\nResponse 1:\na SCORES=10,5,0\n\nResponse 2:\nb\n\nResponse 3:\nc"


def test_start_errors_name_the_problem(server, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(ConfigError, match=f"nothing answers at {closed}.*start the judge's server"):
        LLMJudge(closed, "judge", "{completion}")
    with pytest.raises(ConfigError, match="refused the key"):
        LLMJudge(server.url, "judge", "{completion}")  # no key sent
    monkeypatch.setenv("WRONG_KEY", "nope")
    with pytest.raises(ConfigError, match="refused the key"):
        LLMJudge(server.url, "judge", "{completion}", api_key_env="WRONG_KEY")
    with pytest.raises(ConfigError, match="'UNSET_KEY': that environment variable is not set"):
        LLMJudge(server.url, "judge", "{completion}", api_key_env="UNSET_KEY")
    with pytest.raises(ConfigError, match=r"serves \['judge'\], not 'gpt': set kwargs.model"):
        make(server).__class__(server.url, "gpt", "{completion}", api_key_env="JUDGE_KEY")
    with pytest.raises(ConfigError, match="Single '}'"):
        make(server, "{completion} }")
    with pytest.raises(ConfigError, match="{completions} is the field of group: true; use {completion}"):
        make(server, "{completions}")
    with pytest.raises(ConfigError, match=r"scale must be \[low, high\]"):
        make(server, scale=[10, 0])
    judge = make(server, "{completion} vs {reference}")
    with pytest.raises(ConfigError, match=r"field\(s\) \['reference'\] are no dataset column \(columns: \['answer'"):
        score(judge, ["SCORE=1"], answer=["1"], completion_lengths=[1])
    assert server.requests == []  # nothing was sent for a template it cannot fill


def test_the_recipes_judge_is_taught_the_verdict_right_after_the_generation_prompt():
    from gspo_lightning.data.tasks.successor_judge import MODEL, encode, verdict
    from gspo_lightning.models.tiny import build_tiny

    assert [verdict(7, a) for a in ("8 8 8 8", "8", "7 8 8 8", "", "next 8")] == ["1", "1", "0", "0", "0"]
    _, tokenizer = build_tiny(MODEL)
    ids, start = encode(tokenizer, 7, "8 3")
    assert tokenizer.decode(ids[:start]) == "user: next 7 answer 8 3 assistant:"  # as a server renders the request
    assert ids[start:] == [tokenizer.convert_tokens_to_ids("1"), tokenizer.eos_token_id]
    assert tokenizer.unk_token_id not in ids  # every word of the judge's prompt is in its vocabulary
