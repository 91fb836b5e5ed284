"""One ``openai.AsyncOpenAI`` client for the example agents, re-keyed per episode.

Three costs of the client, measured on these CPU hosts with 512 concurrent episodes of 3 calls
against a server that answers after 20 ms (``python benchmarks/bench_agents.py --client``):

- a new client builds an SSL context, about 40 ms, more than a tiny model's whole turn: the
  agents make one per event loop (a client's connections belong to the loop that opened them)
  and give each episode ``with_options(api_key=...)``, which shares it;
- httpx's connection pool walks every connection it holds on each request: 512 open
  connections cost 4.5-4.9 ms per call against 2.4-2.6 ms with the pool bounded to 32;
- the openai package's aiohttp transport (``openai.DefaultAioHttpClient``; aiohttp is a
  dependency of gspo-lightning) costs the same with 32 or 512 connections, 1.7-2.1 ms per
  call (1.5 ms on a quiet machine: docs/agents.md, "Measured"). The agents use
  it with a pool as large as any step's episodes, so every running agent can send its call at
  once (``episodes.batch_window_s: null`` then never waits for an agent that cannot call).
"""

from __future__ import annotations

import asyncio

MAX_CONNECTIONS = 1024  # at least the episodes that run at once
_clients: dict = {}


def episode_client(base_url: str, api_key: str):
    """An ``AsyncOpenAI`` client for one episode's ``base_url`` and ``api_key`` (call inside the agent)."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        import openai

        try:  # the HTTP library the openai package is built on: httpx2 in newer releases
            import httpx2 as httpx
        except ImportError:
            import httpx
        limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS)
        try:
            http_client = openai.DefaultAioHttpClient(limits=limits)
        except RuntimeError:  # an openai release that cannot use aiohttp: httpx's own pool
            http_client = openai.DefaultAsyncHttpxClient(limits=limits)
        _clients.clear()  # a client of a loop that ended cannot be used again
        _clients[loop] = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client)
    return _clients[loop].with_options(base_url=base_url, api_key=api_key)


__all__ = ["MAX_CONNECTIONS", "episode_client"]
