"""The rollout server's HTTP + JSON API: one named function per route, over a
:class:`~gspo_lightning.rollout.server.host.RolloutServer`.

=======================  =================================================================
``GET /health``          ``{"ok": true}``
``GET /info``            model identity (``model``, ``fingerprint`` of parameter names and
                         shapes, ``eos_token_ids``, ``pad_token_id``, ``dtype``, ``engine``),
                         ``server_id`` (new at every start), ``version`` and ``checksum`` of
                         the weights it serves (``-1`` / ``null`` before the first push),
                         ``session`` (whether a trainer holds the server)
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

Errors reply ``{"error": "...", "kind": ...}`` with status 400 (a bad request), 409 (held
by another trainer, or not at the requested version) or 500. The standard library's
``ThreadingHTTPServer`` is enough here: requests are few and large (one per rollout and per
push), and it adds no dependency.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from gspo_lightning.rollout.server.host import RolloutServer, VersionError
from gspo_lightning.rollout.server.lease import SessionError

Route = Callable[[RolloutServer, dict], dict]


def health(app: RolloutServer, body: dict) -> dict:
    return {"ok": True}


def info(app: RolloutServer, body: dict) -> dict:
    return app.info()


def open_session(app: RolloutServer, body: dict) -> dict:
    app.lease.hold(body.get("token"))
    return app.info()


def close_session(app: RolloutServer, body: dict) -> dict:
    app.lease.release(body.get("token"))
    return {"ok": True}


def load_weights(app: RolloutServer, body: dict) -> dict:
    return app.load(body.get("token"), int(body["version"]), body["manifest"])


def generate(app: RolloutServer, body: dict) -> dict:
    return app.generate(body.get("token"), body["prompt_ids"], int(body["n"]), body["params"], int(body["seed"]),
                        body.get("version"))


ROUTES: dict[tuple[str, str], Route] = {
    ("GET", "/health"): health,
    ("GET", "/info"): info,
    ("POST", "/session"): open_session,
    ("POST", "/session/close"): close_session,
    ("POST", "/weights"): load_weights,
    ("POST", "/generate"): generate,
}


def http_server(app: RolloutServer, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server answering :data:`ROUTES` for ``app`` (not yet serving: call ``serve_forever``)."""
    server = ThreadingHTTPServer((host, port), handler_for(app))
    server.daemon_threads = True
    return server


def handler_for(app: RolloutServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
            pass  # one line per request would drown the trainer's output

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            route = ROUTES.get((method, self.path.split("?")[0]))
            if route is None:
                self._reply(404, {"error": f"no route {method} {self.path}", "kind": "not_found"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                self._reply(200, route(app, body))
            except (SessionError, VersionError) as error:
                self._reply(409, {"error": str(error), "kind": "session" if isinstance(error, SessionError) else "version"})
            except (ValueError, KeyError, TypeError, FileNotFoundError) as error:
                self._reply(400, {"error": f"{type(error).__name__}: {error}", "kind": "bad_request"})
            except Exception as error:  # noqa: BLE001 - the client gets the reason, the server stays up
                self._reply(500, {"error": f"{type(error).__name__}: {error}", "kind": "internal"})

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._route("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._route("POST")

    return Handler


__all__ = ["ROUTES", "handler_for", "http_server"]
