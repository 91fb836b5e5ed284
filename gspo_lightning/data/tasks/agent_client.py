"""One ``openai.AsyncOpenAI`` client for the example agents, re-keyed per episode.

A new client builds an SSL context (about 40 ms on these CPU hosts, more than a tiny model's
whole turn), so the agents make one per event loop (a client's connections belong to the loop
that opened them) and give each episode ``with_options(api_key=...)``, which shares it.
"""

from __future__ import annotations

import asyncio

_clients: dict = {}


def episode_client(base_url: str, api_key: str):
    """An ``AsyncOpenAI`` client for one episode's ``base_url`` and ``api_key`` (call inside the agent)."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        import openai

        _clients.clear()  # a client of a loop that ended cannot be used again
        _clients[loop] = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return _clients[loop].with_options(base_url=base_url, api_key=api_key)


__all__ = ["episode_client"]
