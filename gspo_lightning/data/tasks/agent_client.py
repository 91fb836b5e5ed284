"""One ``openai.AsyncOpenAI`` client for the example agents, re-keyed per episode.

Two costs of the client, measured on these CPU hosts with 512 concurrent episodes of 3 calls
against a server that answers after 20 ms (``python benchmarks/bench_agents.py --client``):

- a new client builds an SSL context, about 40 ms, more than a tiny model's whole turn: the
  agents make one per event loop (a client's connections belong to the loop that opened them)
  and give each episode ``with_options(api_key=...)``, which shares it;
- httpx's connection pool walks every connection it holds on each request, so 512 open
  connections cost 5.5-8.3 ms per call against 2.9-3.1 ms with the pool bounded to 32
  (requests beyond wait for a free connection; the endpoint batches calls anyway).
"""

from __future__ import annotations

import asyncio

MAX_CONNECTIONS = 32
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
        _clients.clear()  # a client of a loop that ended cannot be used again
        _clients[loop] = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                            http_client=openai.DefaultAsyncHttpxClient(limits=limits))
    return _clients[loop].with_options(base_url=base_url, api_key=api_key)


__all__ = ["MAX_CONNECTIONS", "episode_client"]
