"""How long a connection may hold the endpoint without a request being served, and how many may.

aiohttp bounds a request's size but not how long its headers may take to arrive: a client that
sends half a request line and waits would hold a socket forever. Each connection here has a
deadline, ``idle_s`` after it opened or after its last reply; while a request is being served it
has none (the agent's own timeout bounds that). A sweep closes connections past their deadline,
and a connection above ``max_connections`` is closed as it opens.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Callable


class ConnectionWatch:
    """Deadlines on the endpoint's connections (see the module's docstring)."""

    def __init__(self, idle_s: float, max_connections: int):
        self.idle_s = idle_s
        self.max_connections = max_connections
        self.deadlines: dict[asyncio.BaseTransport, float] = {}

    def protocol_factory(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """``factory`` (aiohttp's server) with each protocol's connection watched."""
        return lambda: _Watched(factory(), self)

    def serving(self, transport) -> None:
        if transport in self.deadlines:
            self.deadlines[transport] = math.inf

    def served(self, transport) -> None:
        if transport in self.deadlines:
            self.deadlines[transport] = time.monotonic() + self.idle_s

    async def sweep(self) -> None:
        """Close connections past their deadline, for as long as the loop runs."""
        while True:
            await asyncio.sleep(min(1.0, self.idle_s / 4))
            now = time.monotonic()
            for transport, deadline in list(self.deadlines.items()):
                if deadline < now:
                    self.deadlines.pop(transport, None)
                    transport.abort()


class _Watched(asyncio.Protocol):
    """aiohttp's protocol for one connection (its class has ``__slots__``: wrapped, not patched)."""

    def __init__(self, inner: asyncio.Protocol, watch: ConnectionWatch):
        self.inner = inner
        self.watch = watch
        self.transport = None

    def connection_made(self, transport) -> None:
        self.inner.connection_made(transport)
        if len(self.watch.deadlines) >= self.watch.max_connections:
            transport.abort()  # the endpoint is full: the client may retry
            return
        self.transport = transport
        self.watch.deadlines[transport] = time.monotonic() + self.watch.idle_s

    def connection_lost(self, exc) -> None:
        self.watch.deadlines.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


__all__ = ["ConnectionWatch"]
