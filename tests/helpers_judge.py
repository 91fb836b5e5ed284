"""A scripted OpenAI-compatible judge server on 127.0.0.1 for the LLM-judge tests.

It serves ``GET /v1/models`` and ``POST /v1/chat/completions`` over real HTTP (aiohttp, in a
thread of its own), checks the bearer key, records every request body and the most requests
it ever had in flight, and replies by what the user message says:

- ``SCORE=<x>``: replies ``"The score is <x>."``; ``SCORES=<a>,<b>,...``: one ``Response i: s`` line each
- ``SLEEP=<s>``: waits ``s`` seconds first; ``GARBAGE``: a reply with no number
- ``STATUS=<code>``: answers that HTTP status; ``FLAKY``: 503 on the first try of each distinct message
- ``DIGITS:<text>``: the number of digits in the text (a judge of a real, varying behaviour)
- ``HUGE``: a 3 MiB reply; ``REDIRECT``: a 307 to ``/v1/elsewhere``, which records the key it gets
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Optional

from aiohttp import web


class JudgeServer:
    def __init__(self, key: Optional[str] = "judge-key", model: str = "judge"):
        self.key = key
        self.model = model
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.seen: set[str] = set()
        self.redirected_keys: list = []
        self.client_ports: set[int] = set()  # one per TCP connection the judge opened
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> "JudgeServer":
        self._thread.start()
        assert self._started.wait(10), "the judge server did not start"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/elsewhere", self.elsewhere)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        self._started.set()
        self.loop.run_forever()

    def _authorized(self, request: web.Request) -> bool:
        return self.key is None or request.headers.get("Authorization") == f"Bearer {self.key}"

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "bad key"}, status=401)
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def elsewhere(self, request: web.Request) -> web.Response:
        self.redirected_keys.append(request.headers.get("Authorization"))
        return web.json_response({"choices": [{"message": {"content": "5"}}]})

    async def chat(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "bad key"}, status=401)
        body = await request.json()
        self.requests.append(body)
        self.client_ports.add(request.transport.get_extra_info("peername")[1])
        text = body["messages"][-1]["content"]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            sleep = re.search(r"SLEEP=([\d.]+)", text)
            if sleep:
                await asyncio.sleep(float(sleep.group(1)))
            status = re.search(r"STATUS=(\d+)", text)
            if status:
                return web.json_response({"error": "scripted"}, status=int(status.group(1)))
            if "HUGE" in text:
                return web.json_response({"choices": [{"message": {"content": "7" + " " * (3 << 20)}}]})
            if "REDIRECT" in text:
                raise web.HTTPTemporaryRedirect("/v1/elsewhere")
            if "FLAKY" in text and text not in self.seen:
                self.seen.add(text)
                return web.json_response({"error": "busy"}, status=503)
            scores = re.search(r"SCORES=([\d.,]+)", text)
            score = re.search(r"SCORE=([\d.]+)", text)
            digits = text.partition("DIGITS:")[2]
            if "GARBAGE" in text:
                reply = "I would rather not say."
            elif scores:
                reply = "\n".join(f"Response {i + 1}: {s}" for i, s in enumerate(scores.group(1).split(",")))
            elif score:
                reply = f"The score is {score.group(1)}."
            elif "DIGITS:" in text:
                reply = f"{sum(c.isdigit() for c in digits)}"
            else:
                reply = "No opinion."
            return web.json_response({"id": "x", "object": "chat.completion", "model": self.model, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}]})
        finally:
            self.in_flight -= 1
