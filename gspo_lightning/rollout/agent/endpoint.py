"""The agent endpoint: OpenAI's chat-completions API over the run's engine, recording every token.

===============================  ==============================================================
``POST /v1/chat/completions``    a turn sampled by the run's engine with the run's sampling
                                 (the agent's ``temperature`` / ``top_p`` / ``seed`` are
                                 overridden, said once); ``stream: true`` answers with
                                 server-sent events; ``return_token_ids`` adds vLLM's
                                 ``prompt_token_ids`` and ``token_ids``
``GET /v1/models``               the served model (its name is the ``model`` the agent got)
===============================  ==============================================================

Every route needs ``Authorization: Bearer <key>`` with the key of an episode that is running
now (401 otherwise, before anything is read): a key is made fresh for each episode and dies
with it, so a call is attributed to exactly one episode and a late call to none. Bodies above
``max_body_mb`` get 413 and must arrive within ``request_timeout_s``; a reply is never longer
than the episode's token budget. aiohttp serves it on its own event loop thread, so agents
(which run elsewhere) and slow clients never hold the rollout thread, which owns the engine.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from dataclasses import dataclass
from typing import Optional

from gspo_lightning.episodes.parsers import ToolCallParser
from gspo_lightning.episodes.template import ChatRenderer, TemplateNotAppendOnly
from gspo_lightning.rollout.agent.calls import CallQueue, QueuedCall
from gspo_lightning.rollout.agent.connections import ConnectionWatch
from gspo_lightning.rollout.agent.openai_format import ChatRequest, Reply, RequestError, assistant_reply, \
    completion_object, parse_chat_request, stream_events
from gspo_lightning.rollout.agent.record import AgentSession, PreparedCall


@dataclass(frozen=True)
class TurnLimits:
    """What bounds one rollout's turns: the run's sampling and the episode's token budget."""

    temperature: float
    top_p: float
    response_length: int  # an episode's tokens after its prompt: the model's and the environment's
    prompt_length: Optional[int]  # the longest first prompt (data.prompt_length)
    max_turn_tokens: Optional[int]

    @property
    def max_model_len(self) -> Optional[int]:
        return None if self.prompt_length is None else self.prompt_length + self.response_length


def _unauthorized(message: str):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": "authentication_error", "code": 401}}, status=401,
                             headers={"WWW-Authenticate": "Bearer"})


class AgentEndpoint:
    """Serves one run's agent episodes (see the module's docstring).

    Args:
        tokenizer: the policy's tokenizer (renders prompts, decodes turns).
        parser: reads tool calls out of sampled text and writes them back (``episodes.tool_call_parser``).
        renderer_options: ``ChatRenderer`` options (``system_prompt_for_tools``, ``end_of_turn``, ``template_kwargs``).
        model_name: the served model's name.
        host / port: where it listens (port 0: a free one).
        max_body_mb / request_timeout_s: bounds on what a request may send and how long it may take
            (a connection idle for ``request_timeout_s``, or half a request, is closed).
        max_connections: connections at once; more are closed as they open.
        window_s: how long the first waiting call waits for others to join its generation (``None``:
            until every running agent's call is in, for reproducible sampling).
    """

    def __init__(self, tokenizer, parser: ToolCallParser, renderer_options: dict, model_name: str,
                 host: str = "127.0.0.1", port: int = 0, max_body_mb: float = 8.0, request_timeout_s: float = 60.0,
                 max_connections: int = 4096, window_s: Optional[float] = 0.05):
        self.tokenizer = tokenizer
        self.parser = parser
        self.renderer_options = dict(renderer_options)
        self.model_name = model_name
        self.host = host
        self.port = port
        self.max_body_bytes = int(max_body_mb * 2**20)
        self.request_timeout_s = request_timeout_s
        self.watch = ConnectionWatch(request_timeout_s, max_connections)
        self.queue = CallQueue(window_s)
        self.sessions: dict[str, AgentSession] = {}
        self.limits: Optional[TurnLimits] = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._renderers: dict[str, tuple[ChatRenderer, bool]] = {}
        self._noted: set[str] = set()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._runner = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Listen (on a thread of its own) until :meth:`stop`."""
        if self._thread is not None:
            return
        from aiohttp import web

        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            # shutdown_timeout: a stop waits this long for requests still open (aiohttp's default: 60 s)
            self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                         keepalive_timeout=self.request_timeout_s, shutdown_timeout=2.0)
            await self._runner.setup()
            factory = self.watch.protocol_factory(self._runner.server)
            self._server = await asyncio.get_running_loop().create_server(factory, self.host, self.port)
            self.port = self._server.sockets[0].getsockname()[1]
            self._sweep = asyncio.ensure_future(self.watch.sweep())

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(serve())
            except BaseException as err:  # noqa: BLE001 - reported on the starting thread
                failure.append(err)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="gspo-agent-endpoint", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread = None
            raise OSError(f"the agent endpoint could not listen on {self.host}:{self.port} ({failure[0]}); set "
                          "model.episodes.endpoint_port to a free port, or 0 for any") from failure[0]

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def open_episodes(self, sessions: list[AgentSession], limits: TurnLimits, concurrent: Optional[int] = None) -> None:
        """Serve these episodes' keys (and no others) under ``limits`` until :meth:`close_episodes`;
        ``concurrent`` agents run at once (``None``: all)."""
        self.limits = limits
        self.queue.reset(len(sessions), concurrent)
        self._locks = {s.key: asyncio.Lock() for s in sessions}
        self.sessions = {s.key: s for s in sessions}

    def close_episodes(self) -> None:
        for session in self.sessions.values():
            session.open = False
        self.sessions = {}

    def end_episode(self, session: AgentSession) -> None:
        """The episode's agent returned (or failed): its key answers 401 from now on."""
        session.open = False
        self.sessions.pop(session.key, None)
        self.queue.agent_finished()

    def stop(self) -> None:
        if self._thread is None:
            return
        async def shut() -> None:
            self._sweep.cancel()
            self._server.close()
            await self._runner.cleanup()

        future = asyncio.run_coroutine_threadsafe(shut(), self._loop)
        try:
            future.result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._thread = None

    # -- routes -------------------------------------------------------------------------------
    def _session(self, request) -> Optional[AgentSession]:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        session = self.sessions.get(key.strip())
        return session if session is not None and session.open else None

    async def _models(self, request):
        from aiohttp import web

        if self._session(request) is None:
            return _unauthorized("an episode's API key is needed (Authorization: Bearer <key>)")
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "owned_by": "gspo-lightning"}]})

    async def _chat_completions(self, request):
        self.watch.serving(request.transport)
        try:
            return await self._chat_completions_served(request)
        finally:
            self.watch.served(request.transport)

    async def _chat_completions_served(self, request):
        from aiohttp import web

        session = self._session(request)
        if session is None:
            return _unauthorized("unknown or expired API key: each episode's key is valid while its episode runs "
                                 "(use the api_key your agent was called with)")
        try:
            try:
                body = await asyncio.wait_for(request.json(), self.request_timeout_s)
            except asyncio.TimeoutError as err:
                raise RequestError(f"the request body did not arrive within {self.request_timeout_s:g} s", 408) from err
            except web.HTTPRequestEntityTooLarge as err:
                raise RequestError(f"the body is larger than {self.max_body_bytes} bytes", 413) from err
            except ValueError as err:
                raise RequestError(f"the body is not JSON ({err})") from err
            chat = parse_chat_request(body)
            if chat.model != self.model_name:
                raise RequestError(f"the model {chat.model!r} is not served here: use the model your agent was called "
                                   f"with ({self.model_name!r})", 404, "not_found_error")
            self._note_overrides(chat)
            reply = await self._turn(session, chat)
        except RequestError as err:
            return web.json_response(err.payload(), status=err.status)
        if reply is None:
            return _unauthorized("the episode ended while the call waited (its agent timed out)")
        if not chat.stream:
            return web.json_response(completion_object(reply, chat, self.model_name))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in stream_events(reply, chat, self.model_name):
            await response.write(event)
        await response.write_eof()
        return response

    # -- a turn -------------------------------------------------------------------------------
    def _renderer(self, chat: ChatRequest) -> tuple[ChatRenderer, bool]:
        key = chat.tools_key
        if key not in self._renderers:
            if len(self._renderers) >= 64:  # one per set of tools seen: bounded, whatever the agents send
                self._renderers.clear()
            renderer = ChatRenderer(self.tokenizer, chat.tools, **self.renderer_options)
            self._renderers[key] = (renderer, re.search(r"\btool_calls\b", renderer.template) is not None)
        return self._renderers[key]

    async def _turn(self, session: AgentSession, chat: ChatRequest) -> Optional[Reply]:
        """Render, sample (through the rollout thread's batches) and record one turn of ``session``."""
        async with self._locks[session.key]:  # one call of an episode at a time: each sees the last recorded
            if not session.open:
                return None
            session.calls += 1
            try:
                renderer, renders_tool_calls = self._renderer(chat)
                call = session.prepare(chat.messages, chat.tools_key, renderer, self.parser, renders_tool_calls)
            except TemplateNotAppendOnly as err:
                raise RequestError(f"the chat template cannot render this conversation: {err}") from err
            except (ValueError, TypeError) as err:
                raise RequestError(f"the messages cannot be rendered: {err}") from err
            room = self._room(session, call, chat.max_tokens)
            if room <= 0:  # the episode's budget is spent: an empty turn, nothing recorded
                session.budget_spent = True
                return Reply({"role": "assistant", "content": ""}, "length", call.prompt_ids, [], [], [])
            loop = asyncio.get_running_loop()
            queued = QueuedCall(call.prompt_ids, room, loop, loop.create_future(), episode=session.index)
            self.queue.submit(queued)
            try:
                ids, logprobs, truncated, version = await queued.future
            except RuntimeError as err:  # the engine failed, or the rollout ended (a stop): a reply, not a traceback
                raise RequestError(str(err), 503, "server_error") from err
            if not session.open:
                return None
            return self._record(session, call, chat, ids[:room], logprobs[:room],
                                cut=truncated or len(ids) > room, version=version)

    def _room(self, session: AgentSession, call: PreparedCall, max_tokens: Optional[int]) -> int:
        """How many tokens this turn may sample: the episode's budget, the turn's cap, the agent's max_tokens."""
        limits = self.limits
        if call.new_segment and not session.segments and limits.prompt_length is not None \
                and len(call.prompt_ids) > limits.prompt_length:
            raise RequestError(f"the episode's first prompt is {len(call.prompt_ids)} tokens (the messages, the tools' "
                               f"description and the template's own text), more than data.prompt_length="
                               f"{limits.prompt_length}: raise data.prompt_length to at least {len(call.prompt_ids)}")
        used = 0 if call.new_segment else len(call.segment.ids) + len(call.environment_ids)
        room = limits.response_length - used
        if limits.max_model_len is not None:
            room = min(room, limits.max_model_len - len(call.prompt_ids))
        return min(room, limits.max_turn_tokens or room, max_tokens or room)

    def _record(self, session: AgentSession, call: PreparedCall, chat: ChatRequest, ids: list[int],
                logprobs: list[float], cut: bool, version: Optional[int]) -> Reply:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stopped = False
        for stop in chat.stop:  # the turn ends at the first token whose text completes a stop string
            at = text.find(stop)
            if at >= 0:
                keep = next(n for n in range(1, len(ids) + 1)
                            if stop in self.tokenizer.decode(ids[:n], skip_special_tokens=True))
                ids, logprobs = ids[:keep], logprobs[:keep]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                text = text[:text.find(stop)]
                stopped = True
                break
        closed = not cut and not stopped
        parser = self.parser if chat.parses_tool_calls else None
        message = assistant_reply(text, parser)
        # a turn the token cap cut is "length" even when a call was read out of it (OpenAI's rule):
        # the model did not end it, and the agent decides whether to act on its calls
        finish = "length" if cut else ("tool_calls" if message.get("tool_calls") else "stop")
        tokens = [self.tokenizer.decode([i]) for i in ids] if chat.logprobs else []
        session.record(call, ids, logprobs, version, closed, text, message)
        return Reply(message, finish, call.prompt_ids, ids, logprobs, tokens)

    def _note_overrides(self, chat: ChatRequest) -> None:
        limits = self.limits
        asked = {key: value for key, value in (("temperature", chat.temperature), ("top_p", chat.top_p), ("seed", chat.seed))
                 if value is not None}
        if limits is None or not asked or "sampling" in self._noted:
            return
        if asked.get("temperature", limits.temperature) != limits.temperature or \
                asked.get("top_p", limits.top_p) != limits.top_p or "seed" in asked:
            self._noted.add("sampling")
            print(f"agent endpoint: the agent asked for {asked}; turns are sampled with the run's settings "
                  f"(temperature={limits.temperature}, top_p={limits.top_p}, the run's seeds), so the policy trained is "
                  "the one that sampled (said once)", file=sys.stderr, flush=True)


__all__ = ["AgentEndpoint", "TurnLimits"]
