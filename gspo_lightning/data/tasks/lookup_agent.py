"""The lookup task as a user's agent: plain ``openai`` client code with the OpenAI tools API,
trained through the agent endpoint (``model.episodes.agent``; configs/agent_lookup.yaml).

It is the twin of :class:`~gspo_lightning.data.tasks.lookup.LookupEnvironment`: the same task,
the same tool, but the agent owns the loop (its client: ``agent_client.py``).
"""

from __future__ import annotations

import json
from typing import Optional

from gspo_lightning.data.tasks.agent_client import episode_client

TOOLS = [{"type": "function", "function": {
    "name": "get", "description": "The value the row's table holds for a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "a, b, c, d, e or f"}},
                   "required": ["key"]}}}]


async def lookup_agent(row: dict, base_url: str, api_key: str, model: str, max_turns: int = 3) -> Optional[float]:
    """Ask for the row's key; answer each ``get`` call from the row's table; stop at a turn with
    no call, or at one cut short (``finish_reason: length``: the model did not end it, so its
    call is not taken, as the built-in environment's runner ends such an episode). Returns None:
    the run's reward functions score the recorded conversation."""
    client = episode_client(base_url, api_key)
    table = dict(zip("abcdef", str(row["table"]).split()))
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or reply.choices[0].finish_reason == "length":
            break
        for call in message.tool_calls:
            key = json.loads(call.function.arguments).get("key")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": table.get(key, "error")})
    return None


__all__ = ["TOOLS", "lookup_agent"]
