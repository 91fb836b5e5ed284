"""The slow-tool arms of bench_agents.py: a 1 s action per episode, once in the built-in runner
(the environment's reset, which the runner calls episode after episode) and once in an agent
(a tool the agent runs before its first call, awaited while other episodes generate)."""

from __future__ import annotations

import asyncio
import time

from gspo_lightning.data.tasks.lookup import LookupEnvironment
from gspo_lightning.data.tasks.lookup_agent import lookup_agent

DELAY_S = 1.0


class SlowLookupEnvironment(LookupEnvironment):
    """The lookup environment whose episode starts with a 1 s tool call."""

    def reset(self, row: dict, prompt: list[dict]) -> list[dict]:
        time.sleep(DELAY_S)
        return super().reset(row, prompt)


async def slow_lookup_agent(row: dict, base_url: str, api_key: str, model: str):
    """The lookup agent after a 1 s tool call of its own."""
    await asyncio.sleep(DELAY_S)
    return await lookup_agent(row, base_url, api_key, model)
