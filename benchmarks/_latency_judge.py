"""bench_judge_overlap.py's judge: an OpenAI-compatible chat endpoint on 127.0.0.1 that answers each
request after a fixed latency with the successor judge's verdict (``1`` when the answer starts
with the prompt's successor). Only requests with the key in ``BENCH_JUDGE_KEY`` are read; bodies
over 64 KiB are refused."""

from __future__ import annotations

import argparse
import asyncio
import os
import re

from aiohttp import web

from gspo_lightning.data.tasks.successor_judge import verdict


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency-s", type=float, required=True)
    parser.add_argument("--port-file", required=True)
    args = parser.parse_args()
    key = os.environ["BENCH_JUDGE_KEY"]

    async def chat(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "bad key"}, status=401)
        body = await request.json()
        await asyncio.sleep(args.latency_s)
        text = body["messages"][-1]["content"]
        match = re.match(r"next (\d) answer ?(.*)", text)
        reply = verdict(int(match.group(1)), match.group(2)) if match else "0"
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]})

    async def models(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "bad key"}, status=401)
        return web.json_response({"data": [{"id": "judge"}]})

    async def serve() -> None:
        app = web.Application(client_max_size=64 << 10)
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        with open(args.port_file, "w") as handle:
            handle.write(str(site._server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
