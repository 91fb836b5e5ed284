"""Helpers of the agent-endpoint tests: agents written with the real ``openai`` client (called
by import path, as a config names them), an engine whose answer depends only on its prompt (so
batching cannot change what an episode samples), and a runner over the tiny lookup model."""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time

from gspo_lightning.data.tasks.lookup import WordCallParser
from gspo_lightning.episodes.multi_turn import MultiTurn
from gspo_lightning.models.tiny import build_tokenizer, get_spec
from gspo_lightning.rollout.agent.runner import AgentRunner
from gspo_lightning.rollout.engine import Generation, RolloutEngine, SamplingParams

# tiny-lookup's ids: <pad> 0, <eos> 1, <unk> 2, then tiny.LOOKUP_WORDS in order
PAD, EOS, USER, ASSISTANT, TOOL, FIND, GET = 0, 1, 3, 4, 5, 6, 7
KEY = {k: 9 + i for i, k in enumerate("abcdef")}
DIGIT = {d: 15 + d for d in range(10)}
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]


def rows(count: int, seed: int = 3) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        table = [str(rng.randrange(10)) for _ in "abcdef"]
        key = "abcdef"[index % 6]
        out.append({"prompt": f"find {key}", "key": key, "table": " ".join(table), "answer": table["abcdef".index(key)],
                    "index": index})
    return out


class PromptEngine(RolloutEngine):
    """Answers from the prompt alone: ``get <key>`` until the prompt holds ``calls`` tool replies,
    then the last reply's digit; each token's log-prob ``-0.1 * (1 + its position in the turn)``."""

    shares_policy_weights = True

    def __init__(self, calls: int = 1):
        super().__init__()
        self.calls = calls
        self.batches: list[int] = []
        self.lock = threading.Lock()

    def start(self, spec) -> None:
        pass

    def generate(self, prompt_ids, n, params, seed):
        with self.lock:
            self.batches.append(len(prompt_ids))
        responses = []
        for prompt in prompt_ids:
            key = next((prompt[i + 1] for i in range(len(prompt) - 1) if prompt[i] == FIND), KEY["a"])
            if prompt.count(TOOL) < self.calls:
                ids = [GET, key, EOS]
            else:
                ids = [prompt[len(prompt) - 1 - prompt[::-1].index(TOOL) + 1], EOS]
            responses.append(ids[:params.max_new_tokens])
        logprobs = [[-0.1 * (1 + i) for i in range(len(ids))] for ids in responses]
        truncated = [EOS not in ids for ids in responses]
        return Generation.from_lists(responses, logprobs, truncated, PAD)


def runner(agent: str, **episodes) -> AgentRunner:
    """An :class:`AgentRunner` over tiny-lookup's tokenizer for the agent at import path ``agent``."""
    tokenizer = build_tokenizer(get_spec("tiny-lookup"))
    settings = dict(agent=agent, tool_call_parser=WordCallParser(), system_prompt_for_tools=None, max_turns=4,
                    max_turn_tokens=3, end_of_turn="")
    settings.update(episodes)
    multi_turn = MultiTurn(**settings)
    multi_turn.start(tokenizer, prompt_length=8)
    return AgentRunner(multi_turn, model_name="tiny-lookup")


def run(agent: str, engine: RolloutEngine, batch: list[dict], group_size: int = 1, response_length: int = 12,
        **episodes):
    """One rollout of ``batch`` through the agent; returns ``(episode batch, runner's sessions)``."""
    agents = runner(agent, **episodes)
    try:
        result = agents.run(engine, [r["prompt"] for r in batch], batch, group_size,
                            SamplingParams(max_new_tokens=response_length), seed=5)
    finally:
        agents.close()
    return result


# -- agents, as users write them ----------------------------------------------------------------
def _answer_calls(message, table: dict) -> list[dict]:
    return [{"role": "tool", "tool_call_id": call.id, "content": table.get(json.loads(call.function.arguments)["key"],
                                                                          "error")}
            for call in message.tool_calls]


def lookup_agent(row, base_url, api_key, model):
    """A plain synchronous ``openai`` agent: call, run the tools, until a turn makes no call."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    table = dict(zip("abcdef", row["table"].split()))
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(6):
        message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        messages += _answer_calls(message, table)
    return None


async def slow_async_agent(row, base_url, api_key, model):
    """Async, with a random pause before each call (so episodes' calls interleave), and its tool
    replies marked with the row's own digits: a call attributed to another episode shows."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    rng = random.Random(row["index"])
    table = dict(zip("abcdef", row["table"].split()))
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(6):
        await asyncio.sleep(rng.random() * 0.05)
        reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(message.content.strip() == row["answer"])
        messages += _answer_calls(message, table)
    return 0.0


def faulty_agent(row, base_url, api_key, model):
    """Fails as its row says: ``raise``, ``hang`` (past any test timeout), ``silent`` (never calls),
    ``wrong_type`` (returns text), ``exit`` (ends its process); else a normal lookup episode."""
    behaviour = row.get("behaviour", "")
    if behaviour == "raise":
        raise KeyError("the agent's bug")
    if behaviour == "exit":  # the whole process goes (an agent's native library crashing), once the others ended
        deadline = time.monotonic() + 30
        while _finished["count"] < row.get("others", 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.0)  # the others' results leave the worker after their functions return
        os._exit(3)
    if behaviour == "hang":
        time.sleep(30)
    if behaviour == "silent":
        return None
    result = lookup_agent(row, base_url, api_key, model)
    _finished["count"] += 1
    return "done" if behaviour == "wrong_type" else result


_finished = {"count": 0}  # normal episodes ended in this process


def editing_agent(row, base_url, api_key, model):
    """Edits its history before the second call (the first user message changes): a fork."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    messages += _answer_calls(message, dict(zip("abcdef", row["table"].split())))
    messages[0] = {"role": "user", "content": f"find {row['key']} find {row['key']}"}
    client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
    return None


_episodes_started = {"count": 0}


def fails_after_first_step(row, base_url, api_key, model):
    """A lookup agent that raises from its 17th episode on (the second step of a 4 x 4 run)."""
    _episodes_started["count"] += 1
    if _episodes_started["count"] > 16:
        raise ConnectionError("the agent's sandbox went away")
    return lookup_agent(row, base_url, api_key, model)


def agent_config(folder, steps: int = 2, **model) -> str:
    """configs/agent_lookup.yaml shrunk to ``steps`` steps of 4 prompts x 4 episodes."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    config = yaml.safe_load((root / "configs" / "agent_lookup.yaml").read_text())
    config["trainer"].update({"max_steps": steps, "default_root_dir": str(folder), "val_check_interval": steps,
                              "num_sanity_val_steps": 0, "enable_progress_bar": False})
    config["data"].update({"val_size": 4, "rollout_batch_size": 4})
    config["model"]["rollout"]["num_return_sequences_in_group"] = 4
    config["model"]["update"]["mini_batch_size"] = 8
    config["model"]["export_on_fit_end"] = False
    # the agents in this process, batches by the default window: the helpers' agents count episodes
    # in module state, and the tests that want reproducible batches ask for them
    config["model"]["episodes"].update({"agent_processes": 0, "batch_window_s": 0.05})
    for key, value in model.items():  # "block.field" or a model key
        block, _, field = key.partition(".")
        if field:
            config["model"].setdefault(block, {})[field] = value
        else:
            config["model"][key] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


_sdk_episodes = {"count": 0}


async def alternating_calculator_agent(row, base_url, api_key, model):
    """The Agents SDK calculator agent (gspo_lightning/data/tasks/calculator_agent.py), its
    ``Runner.run_streamed`` form for every other episode: one run tries both."""
    from gspo_lightning.data.tasks.calculator_agent import calculator_agent, streamed_calculator_agent

    _sdk_episodes["count"] += 1
    agent = streamed_calculator_agent if _sdk_episodes["count"] % 2 else calculator_agent
    return await agent(row=row, base_url=base_url, api_key=api_key, model=model)

