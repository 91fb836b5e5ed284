"""The calculator task as an OpenAI Agents SDK agent: ``Agent`` with a ``function_tool``, run by
``Runner`` against the run's agent endpoint (configs/agent_calculator_cpu.yaml).

The same task as the built-in recipe (configs/smollm2_tools_cpu.yaml): two-digit sums, an ``add``
tool, one worked exchange before the question (SmolLM2's template has no tools section; the
endpoint shows the tools in a system message and writes the example's call in the Hermes
format the model then copies). Returns None: ``calculator_reward`` scores the recorded episode;
0.0 when the model calls a tool that does not exist (the SDK raises ``ModelBehaviorError``).
"""

from __future__ import annotations

import json
from typing import Optional

from gspo_lightning.data.tasks.agent_client import episode_client
from gspo_lightning.data.tasks.calculator import add


def worked_example() -> list[dict]:
    """One exchange as the Agents SDK's input items: a question, the call, its output, the answer."""
    return [
        {"role": "user", "content": "What is 23 + 45? Answer with only the number."},
        {"type": "function_call", "call_id": "call_example", "name": "add", "arguments": json.dumps({"a": 23, "b": 45})},
        {"type": "function_call_output", "call_id": "call_example", "output": "68"},
        {"role": "assistant", "content": "68"},
    ]


async def _run(row: dict, base_url: str, api_key: str, model: str, stream: bool) -> Optional[float]:
    from agents import Agent, MaxTurnsExceeded, ModelBehaviorError, OpenAIChatCompletionsModel, Runner, function_tool, \
        set_tracing_disabled

    set_tracing_disabled(True)  # traces go to OpenAI's servers by default: not from a training run
    agent = Agent(name="calculator", tools=[function_tool(add)],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=episode_client(base_url, api_key)))
    question = [*worked_example(), {"role": "user", "content": row["prompt"]}]
    try:
        if stream:
            result = Runner.run_streamed(agent, question, max_turns=3)
            async for _ in result.stream_events():
                pass
        else:
            await Runner.run(agent, question, max_turns=3)
    except MaxTurnsExceeded:
        pass  # the recorded turns are scored like any episode that ran out of turns
    except ModelBehaviorError:
        return 0.0  # the model called a tool that does not exist: its mistake, a wrong answer, not the agent's bug
    return None


async def calculator_agent(row: dict, base_url: str, api_key: str, model: str) -> Optional[float]:
    """The Agents SDK's ``Runner.run``."""
    return await _run(row, base_url, api_key, model, stream=False)


async def streamed_calculator_agent(row: dict, base_url: str, api_key: str, model: str) -> Optional[float]:
    """The same agent through ``Runner.run_streamed`` (server-sent events)."""
    return await _run(row, base_url, api_key, model, stream=True)


__all__ = ["calculator_agent", "streamed_calculator_agent", "worked_example"]
