"""The rollout server's HTTP + JSON API: one named function per route, over a
:class:`~gspo_lightning.rollout.server.host.RolloutServer`.

=======================  =================================================================
``GET /health``          ``{"ok": true}``; the only route that needs no secret
``GET /info``            model identity (``model``, ``fingerprint`` of parameter names and
                         shapes, ``eos_token_ids``, ``pad_token_id``, ``dtype``, ``engine``,
                         ``max_new_tokens``), ``server_id`` (new at every start), ``version``
                         and ``checksum`` of the weights it serves (``-1`` / ``null`` before
                         the first push), ``session`` (whether a trainer holds the server)
``POST /session``        ``{"token"}``: hold the server for one trainer (its ranks share the
                         token); 409 while another trainer holds it (until ``lease_s`` idle)
``POST /session/close``  ``{"token"}``: let it go
``POST /weights``        ``{"token", "version", "manifest"}``: load the pushed weights (the
                         manifest of a ``transport.WeightTransport``); replies ``version``,
                         ``checksum`` of the weights now held, ``seconds``, ``tensors``, ``bytes``
``POST /generate``       ``{"token", "prompt_ids", "n", "params", "seed", "version"}``: waits
                         up to ``version_wait_s`` for ``version`` or a newer one (409 if none),
                         replies ``completion_ids`` and ``logprobs`` (one list per response,
                         unpadded), ``truncated``, ``version``, ``checksum``
=======================  =================================================================

and the part of vLLM's API that ``StockVLLMEngine`` drives (``vllm_api.py``: ``/v1/models``,
``/v1/completions`` on token ids, ``/pause``, ``/resume``, ``/is_paused``, ``/collective_rpc``
``reload_weights``, ``/update_weight_version``, ``/reset_prefix_cache``), so that one client
drives stock vLLM servers and this one.

Every route but ``/health`` needs ``Authorization: Bearer <secret>`` (``auth.py``; a server
always has one), else 401, and nothing is read or done. Errors reply ``{"error": "...", "kind":
...}`` with status 400 (a bad request), 401, 404, 411 (no ``Content-Length``), 413 (a body
above ``max_body_mb``), 409 (held by another trainer, or not at the requested version), 503
(``max_connections`` busy: retry) or 500.

The standard library's ``ThreadingHTTPServer``, hardened here rather than replaced by
uvicorn: requests are few and large (one per rollout and per push), the base install gains
no dependency, and every limit is a few lines that ``tests/test_server_security.py`` attacks
(docs/scaling.md#security says why in full). The limits (``limits.ServerLimits``):

- a request's line, headers and body must arrive within ``request_timeout_s`` in total (a
  watchdog shuts the socket of one that does not, however slowly it trickles), and each
  read times out after as long; a reply must be sent within ``reply_timeout_s``;
- at most ``max_connections`` connections are served at once (one thread each); another is
  answered 503 at once and closed;
- ``Content-Length`` is read and checked before the body: missing 411, not a plain
  non-negative integer (or given twice) 400, above ``max_body_mb`` 413; chunked bodies 411;
- a body is one JSON object (no ``NaN``), else 400; after any refusal the connection closes,
  so an unread body is never taken for the next request.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from gspo_lightning.errors import ConfigError
from gspo_lightning.rollout.server.auth import authorized, is_loopback
from gspo_lightning.rollout.server.host import RolloutServer, VersionError
from gspo_lightning.rollout.server.lease import SessionError
from gspo_lightning.rollout.server.vllm_api import VLLM_ROUTES
from gspo_lightning.rollout.server.limits import BadRequest, ServerLimits, generation_request, session_token, \
    weights_request

Route = Callable[[RolloutServer, dict, dict], dict]  # (server, JSON body, query)


def health(app: RolloutServer, body: dict, query: dict) -> dict:
    return {"ok": True}


def info(app: RolloutServer, body: dict, query: dict) -> dict:
    return app.info()


def open_session(app: RolloutServer, body: dict, query: dict) -> dict:
    app.lease.hold(session_token(body))
    return app.info()


def close_session(app: RolloutServer, body: dict, query: dict) -> dict:
    app.lease.release(session_token(body))
    return {"ok": True}


def load_weights(app: RolloutServer, body: dict, query: dict) -> dict:
    return app.load(**weights_request(body))


def generate(app: RolloutServer, body: dict, query: dict) -> dict:
    return app.generate(**generation_request(body, app.limits, app.vocab_size, app.spec.response_length))


ROUTES: dict[tuple[str, str], Route] = {
    ("GET", "/health"): health,
    ("GET", "/info"): info,
    ("POST", "/session"): open_session,
    ("POST", "/session/close"): close_session,
    ("POST", "/weights"): load_weights,
    ("POST", "/generate"): generate,
    **VLLM_ROUTES,  # the subset of vLLM's API that StockVLLMEngine drives (vllm_api.py)
}
OPEN_ROUTES = {("GET", "/health")}  # answered without the secret
CONTENT_LENGTH = re.compile(r"[0-9]{1,18}")


def _reject_constant(name: str):
    raise BadRequest(f"the body holds {name}: JSON numbers must be finite")


class RolloutHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` with the limits of :class:`ServerLimits`: a thread per
    connection, at most ``max_connections`` of them, and a watchdog that shuts the socket of a
    request not fully received within ``request_timeout_s``."""

    daemon_threads = True
    request_queue_size = 128  # connections waiting to be accepted; the busy ones get 503 at once

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limits: ServerLimits,
                 secret: Optional[str]):
        self.limits, self.secret = limits, secret
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        self._deadlines: dict[socket.socket, float] = {}
        self._watch_lock = threading.Lock()
        self._closed = threading.Event()
        super().__init__(address, handler)
        threading.Thread(target=self._watchdog, name="gspo-serve-watchdog", daemon=True).start()

    # -- half-sent requests --------------------------------------------------------------
    def watch(self, connection: socket.socket) -> None:
        """``connection``'s request must be read within ``request_timeout_s`` from now."""
        with self._watch_lock:
            self._deadlines[connection] = time.monotonic() + self.limits.request_timeout_s

    def unwatch(self, connection: socket.socket) -> None:
        with self._watch_lock:
            self._deadlines.pop(connection, None)

    def _watchdog(self) -> None:
        # a per-read timeout alone lets a client send one byte per timeout forever
        while not self._closed.wait(min(0.25, self.limits.request_timeout_s / 4)):
            now = time.monotonic()
            with self._watch_lock:
                late = [c for c, deadline in self._deadlines.items() if deadline < now]
                for connection in late:
                    del self._deadlines[connection]
            for connection in late:
                try:
                    connection.shutdown(socket.SHUT_RDWR)  # the handler's read returns; its thread ends
                except OSError:
                    pass

    # -- bounded connections -------------------------------------------------------------
    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            busy = json.dumps({"error": f"the rollout server serves {self.limits.max_connections} connections at once "
                                        "(gspo serve --max_connections): retry", "kind": "busy"}).encode()
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(busy), busy))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # a thread for this connection
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.unwatch(request)
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client gone, or dropped by the watchdog: nothing to report
        super().handle_error(request, client_address)

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()


def http_server(app: RolloutServer, host: str = "127.0.0.1", port: int = 0,
                secret: Optional[str] = None) -> RolloutHTTPServer:
    """An HTTP server answering :data:`ROUTES` for ``app`` under ``app.limits`` (not yet
    serving: call ``serve_forever``). It needs a ``secret`` wherever it listens: on loopback
    too, other users of the machine reach it."""
    if not secret:
        where = "other machines" if not is_loopback(host) else "every user of this machine"
        raise ConfigError(f"a rollout server on {host} is reachable by {where}: it needs a secret (GSPO_SERVER_TOKEN or "
                         "--token_file on the server and the trainer; `gspo serve` makes one when given none), and across "
                         "machines a TLS proxy or an SSH tunnel (docs/scaling.md#security)")
    return RolloutHTTPServer((host, port), handler_for(app), app.limits, secret)


def handler_for(app: RolloutServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = app.limits.request_timeout_s  # every read and write of the socket
        server: RolloutHTTPServer

        def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
            pass  # one line per request would drown the trainer's output

        def handle_one_request(self) -> None:
            self.connection.settimeout(self.server.limits.request_timeout_s)  # each read
            self.server.watch(self.connection)  # the whole request, from the first byte of its line
            try:
                super().handle_one_request()
            finally:
                self.server.unwatch(self.connection)

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _refuse(self, status: int, kind: str, message: str) -> None:
            self.close_connection = True  # what is left of the request is never read
            self._reply(status, {"error": message, "kind": kind})

        def _body(self) -> Optional[dict]:
            """The request's JSON object, or ``None`` after a refusal was sent."""
            if self.headers.get("Transfer-Encoding"):
                self._refuse(411, "bad_request", "send the body with a Content-Length, not chunked")
                return None
            lengths = self.headers.get_all("Content-Length") or []
            if not lengths:
                self._refuse(411, "bad_request", "a POST needs a Content-Length header")
                return None
            if len(lengths) > 1 or not CONTENT_LENGTH.fullmatch(lengths[0].strip()):
                self._refuse(400, "bad_request", "Content-Length must be one non-negative integer")
                return None
            length = int(lengths[0])
            if length > self.server.limits.max_body_bytes:
                self._refuse(413, "too_large", f"a body of {length} bytes is above this server's "
                                               f"{self.server.limits.max_body_mb:g} MiB (gspo serve --max_body_mb)")
                return None
            data = self.rfile.read(length)
            if len(data) < length:  # the watchdog or the client closed it half-way
                self.close_connection = True
                return None
            self.server.unwatch(self.connection)  # received whole: the work may take long
            try:
                body = json.loads(data or b"{}", parse_constant=_reject_constant)
            except BadRequest as error:
                self._refuse(400, "bad_request", str(error))
                return None
            except (ValueError, RecursionError) as error:
                self._refuse(400, "bad_request", f"the body is not JSON: {str(error)[:200]}")
                return None
            if not isinstance(body, dict):
                self._refuse(400, "bad_request", f"the body must be a JSON object, got {type(body).__name__}")
                return None
            return body

        def _route(self, method: str) -> None:
            path, _, query_string = self.path.partition("?")
            key = (method, path)
            route = ROUTES.get(key)
            if route is None:
                self._refuse(404, "not_found", f"no route {method} {self.path[:200]}")
                return
            if key not in OPEN_ROUTES and not authorized(self.headers.get("Authorization"), self.server.secret):
                self._refuse(401, "unauthorized", "missing or wrong secret: send Authorization: Bearer <the server's "
                                                  "GSPO_SERVER_TOKEN>")
                return
            if method == "POST":
                body = self._body()
                if body is None:
                    return
            else:
                body = {}
                if self.headers.get("Content-Length", "0").strip() != "0" or self.headers.get("Transfer-Encoding"):
                    self.close_connection = True  # a GET's body is not read: the connection ends with the reply
            self.server.unwatch(self.connection)
            self.connection.settimeout(self.server.limits.reply_timeout_s)  # a large reply may take a while to send
            try:
                query = {k: v[-1] for k, v in urllib.parse.parse_qs(query_string[:1000]).items()}
                self._reply(200, route(app, body, query))
            except (SessionError, VersionError) as error:
                self._reply(409, {"error": str(error), "kind": "session" if isinstance(error, SessionError) else "version"})
            except BadRequest as error:
                self._reply(error.status, {"error": str(error), "kind": "bad_request"})
            except (ValueError, KeyError, TypeError) as error:
                self._reply(400, {"error": f"{type(error).__name__}: {error}", "kind": "bad_request"})
            except Exception as error:  # noqa: BLE001 - the client gets the reason, the server stays up
                self._reply(500, {"error": f"{type(error).__name__}: {error}", "kind": "internal"})

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._route("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._route("POST")

    return Handler


__all__ = ["OPEN_ROUTES", "ROUTES", "RolloutHTTPServer", "handler_for", "http_server"]
