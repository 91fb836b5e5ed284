"""A rollout server: any :class:`RolloutEngine` behind a small HTTP + JSON API.

``gspo serve --config cfg.yaml [--host H] [--port P]`` hosts the engine the config names
(``model.engine``; for a config whose engine is the client, :class:`RemoteEngine`, its
``server_engine``) on the config's model. ``gspo fit`` starts one itself, as a child
process, when the client engine is given no URL. The API (every body is JSON):

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
by another trainer, or not at the requested version) or 500. Generation and weight loads
take one lock: a push waits for the generation in flight, and a generation never sees
two versions. The standard library's ``ThreadingHTTPServer`` is enough here: requests are
few and large (one per rollout and per push), and it adds no dependency.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from gspo_lightning.rollout.engine import EngineSpec, RolloutEngine, SamplingParams
from gspo_lightning.rollout.transport import RECEIVERS, WeightsChecksum

DEFAULT_ENGINE = {"class_path": "gspo_lightning.rollout.HFEngine", "init_args": {}}


@dataclass
class ServerSpec:
    """What a server needs to start its engine (the trainer-side fields of ``EngineSpec``)."""

    model_name_or_path: str
    dtype: str = "float32"
    trust_remote_code: bool = False
    prompt_length: Optional[int] = None
    response_length: int = 256
    seed: int = 0
    engine: dict = field(default_factory=lambda: dict(DEFAULT_ENGINE))


class SessionError(RuntimeError):
    """The server is held by another trainer."""


class VersionError(RuntimeError):
    """The server does not serve the version a request asked for."""


# config entries that decide what a model computes, named alike across transformers versions
# (a trainer and a server may run different ones: the vLLM environment pins its own)
IDENTITY_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "tie_word_embeddings",
                 "num_experts", "num_local_experts", "num_experts_per_tok")


def fingerprint(named_shapes, config: Optional[dict] = None) -> str:
    """The model's identity: its parameter names and shapes, and the config entries that
    shapes do not show (two models can share every shape and split heads differently)."""
    text = "\n".join(f"{name}:{tuple(shape)}" for name, shape in sorted(named_shapes))
    if config:
        kept = {k: config[k] for k in IDENTITY_KEYS if config.get(k) is not None}
        text += "\n" + json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_fingerprint(model: nn.Module, name=lambda n: n) -> str:
    config = getattr(model, "config", None)
    return fingerprint(((name(n), p.shape) for n, p in model.named_parameters()),
                       config.to_dict() if config is not None else None)


def build_engine(engine: dict) -> RolloutEngine:
    """An engine from ``{class_path, init_args}`` (a short name means ``gspo_lightning.rollout``)."""
    class_path = engine.get("class_path") or DEFAULT_ENGINE["class_path"]
    if "." not in class_path:
        class_path = f"gspo_lightning.rollout.{class_path}"
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise ValueError(f"server engine {class_path!r} is not a gspo_lightning RolloutEngine")
    if getattr(cls, "is_client", False):
        raise ValueError(f"a rollout server cannot host {name}, the client engine: give it a generating engine "
                         "(gspo_lightning.rollout.HFEngine or VLLMEngine)")
    return cls(**dict(engine.get("init_args") or {}))


class RolloutServer:
    """An engine, its model identity, the weights version it serves, and who holds it.

    Args:
        spec: the model and engine to serve.
        lease_s: a trainer idle this long loses its hold (a crashed trainer frees the server).
        version_wait_s: how long a generation waits for the weights version it asks for
            (ranks of one trainer ask for the version rank 0 is pushing).
    """

    def __init__(self, spec: ServerSpec, lease_s: float = 120.0, version_wait_s: float = 120.0):
        self.spec = spec
        self.lease_s = lease_s
        self.version_wait_s = version_wait_s
        self.engine = build_engine(spec.engine)
        self.server_id = uuid.uuid4().hex
        self.version = -1
        self.checksum: Optional[str] = None
        self.condition = threading.Condition()  # held by a generation or a weight load
        self._session: Optional[str] = None
        self._last_seen = 0.0
        self._session_lock = threading.Lock()
        self.identity: dict[str, Any] = {}

    # -- start ---------------------------------------------------------------------------
    def start(self) -> None:
        from gspo_lightning.models.loading import eos_token_ids, load_policy, load_tokenizer

        spec = self.spec
        tokenizer = load_tokenizer(spec.model_name_or_path, spec.trust_remote_code)
        model = load_policy(spec.model_name_or_path, tokenizer, spec.dtype, None, spec.trust_remote_code)
        model.eval().requires_grad_(False)
        model.config.use_cache = False
        eos = eos_token_ids(model, tokenizer)
        self.identity = {
            "model": spec.model_name_or_path, "architecture": type(model).__name__,
            "fingerprint": model_fingerprint(model),
            "eos_token_ids": sorted(eos), "pad_token_id": tokenizer.pad_token_id, "dtype": spec.dtype,
            "engine": f"{type(self.engine).__module__}.{type(self.engine).__qualname__}",
        }
        self.engine.start(EngineSpec(
            model_name_or_path=spec.model_name_or_path, dtype=spec.dtype, prompt_length=spec.prompt_length,
            response_length=spec.response_length, seed=spec.seed, eos_token_ids=eos,
            pad_token_id=tokenizer.pad_token_id, trust_remote_code=spec.trust_remote_code,
            policy=model, tokenizer=tokenizer,
        ))
        # the model the engine samples from, to read its weights back after a load (HF engines);
        # None for engines that keep their own (vLLM): their checksum is of what they received
        held = getattr(self.engine, "model", None)
        self.held_model: Optional[nn.Module] = held if isinstance(held, nn.Module) else None

    def info(self) -> dict:
        with self._session_lock:
            held = self._session is not None and time.monotonic() - self._last_seen < self.lease_s
        return {**self.identity, "server_id": self.server_id, "version": self.version, "checksum": self.checksum,
                "session": held}

    # -- sessions ------------------------------------------------------------------------
    def hold(self, token: Optional[str]) -> None:
        """Take or renew the hold for ``token``; refused while another trainer holds the server."""
        if not token:
            raise SessionError("no session token: open a session with POST /session first")
        with self._session_lock:
            now = time.monotonic()
            if self._session not in (None, token) and now - self._last_seen < self.lease_s:
                raise SessionError(f"this rollout server is in use by another trainer (idle {now - self._last_seen:.0f} s; "
                                   f"it frees after {self.lease_s:.0f} s idle): start another server for this run")
            self._session, self._last_seen = token, now

    def release(self, token: Optional[str]) -> None:
        with self._session_lock:
            if self._session == token:
                self._session = None

    # -- weights -------------------------------------------------------------------------
    def load(self, token: str, version: int, manifest: dict) -> dict:
        self.hold(token)
        receive = RECEIVERS.get(manifest.get("kind"))
        if receive is None:
            raise ValueError(f"unknown weight transport {manifest.get('kind')!r}; this server reads {sorted(RECEIVERS)}")
        start = time.perf_counter()
        with self.condition:
            received = WeightsChecksum()
            dtypes: dict[str, torch.dtype] = {}

            def pairs() -> Iterator[tuple[str, Tensor]]:
                for name, tensor in receive(manifest):
                    received.update(name, tensor)
                    dtypes[name] = tensor.dtype
                    yield name, tensor

            self.version = -1  # a load that fails half-way leaves no version behind
            self.checksum = None
            self._load_pairs(pairs(), int(version))
            if received.hexdigest() != manifest.get("checksum"):
                raise ValueError("the weights read differ from what the trainer sent (checksum): a partial or stale "
                                 f"weights folder at {manifest.get('path')}")
            self.checksum = self._held_checksum(manifest["names"], dtypes) or received.hexdigest()
            self.version = int(version)
            self.condition.notify_all()
        self.hold(token)
        return {"version": self.version, "checksum": self.checksum, "seconds": time.perf_counter() - start,
                "tensors": received.tensors, "bytes": received.bytes}

    def _load_pairs(self, pairs: Iterator[tuple[str, Tensor]], version: int) -> None:
        if not self.engine.shares_policy_weights:
            self.engine.update_weights(pairs, version)
            return
        # the engine samples from the server's model: copy into its parameters
        params = dict(self.held_model.named_parameters())
        with torch.no_grad():
            for name, tensor in pairs:
                target = params.get(name)
                if target is None or target.shape != tensor.shape:
                    raise ValueError(f"pushed weight {name!r} {tuple(tensor.shape)} does not fit this server's model "
                                     f"{self.spec.model_name_or_path} ({'missing' if target is None else tuple(target.shape)})")
                target.copy_(tensor)

    def _held_checksum(self, names: list[str], dtypes: dict[str, torch.dtype]) -> Optional[str]:
        """The checksum of the weights the engine now holds, when it can be read back in the
        dtypes that were sent (else ``None``: the checksum of what was received stands)."""
        if self.held_model is None:
            return None
        params = dict(self.held_model.named_parameters())
        if any(name not in params or params[name].dtype != dtypes[name] for name in names):
            return None
        total = WeightsChecksum()
        for name in names:
            total.update(name, params[name])
        return total.hexdigest()

    # -- generation ----------------------------------------------------------------------
    def generate(self, token: str, prompt_ids: list[list[int]], n: int, params: dict, seed: int,
                 version: Optional[int]) -> dict:
        self.hold(token)
        sampling = SamplingParams(**params)
        deadline = time.monotonic() + self.version_wait_s
        with self.condition:
            # a newer version is fine (a trainer that pushed while this request was on its way)
            while version is not None and self.version < version and time.monotonic() < deadline:
                self.condition.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            if version is not None and self.version < version:
                raise VersionError(f"the server serves weights version {self.version}, the request asks for {version} or newer")
            self.engine.wake()
            try:
                generation = self.engine.generate(prompt_ids, n, sampling, seed)
            finally:
                self.engine.sleep()
            served, checksum = self.version, self.checksum
        self.hold(token)
        lengths = generation.lengths.tolist()
        return {
            "completion_ids": [row[:k] for row, k in zip(generation.completion_ids.tolist(), lengths)],
            "logprobs": [row[:k] for row, k in zip(generation.logprobs.tolist(), lengths)],
            "truncated": generation.truncated.tolist(), "version": served, "checksum": checksum,
        }

    def close(self) -> None:
        self.engine.close()

    # -- HTTP ----------------------------------------------------------------------------
    def http_server(self, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer((host, port), _handler(self))
        server.daemon_threads = True
        return server


def _handler(app: RolloutServer):
    routes = {
        ("GET", "/health"): lambda body: {"ok": True},
        ("GET", "/info"): lambda body: app.info(),
        ("POST", "/session"): lambda body: (app.hold(body.get("token")), app.info())[1],
        ("POST", "/session/close"): lambda body: (app.release(body.get("token")), {"ok": True})[1],
        ("POST", "/weights"): lambda body: app.load(body.get("token"), int(body["version"]), body["manifest"]),
        ("POST", "/generate"): lambda body: app.generate(body.get("token"), body["prompt_ids"], int(body["n"]),
                                                         body["params"], int(body["seed"]), body.get("version")),
    }

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
            route = routes.get((method, self.path.split("?")[0]))
            if route is None:
                self._reply(404, {"error": f"no route {method} {self.path}", "kind": "not_found"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                self._reply(200, route(body))
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


# -- the command ---------------------------------------------------------------------------
def spec_from_config(config: dict) -> ServerSpec:
    """The server a ``gspo fit`` config describes: its model, and the engine to host."""
    model = config.get("model") or {}
    data = config.get("data") or {}
    engine = model.get("engine") or dict(DEFAULT_ENGINE)
    if str(engine.get("class_path", "")).endswith("RemoteEngine"):
        engine = (engine.get("init_args") or {}).get("server_engine") or dict(DEFAULT_ENGINE)
    seed = model.get("rollout_seed")
    return ServerSpec(
        model_name_or_path=model.get("model_name_or_path", "builtin:tiny-echo"), dtype=model.get("dtype", "float32"),
        trust_remote_code=bool(model.get("trust_remote_code", False)), prompt_length=data.get("prompt_length"),
        response_length=int(model.get("response_length", 256)),
        seed=int(seed if seed is not None else (config.get("seed_everything") or 0)), engine=engine,
    )


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="gspo serve", description="Serve rollouts for gspo fit (rollout/server.py).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a gspo fit config: its model.* and data.prompt_length")
    source.add_argument("--spec", help="a ServerSpec as JSON (what gspo fit writes for the server it starts)")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--lease_s", type=float, default=120.0, help="a trainer idle this long loses its hold")
    parser.add_argument("--port_file", help=argparse.SUPPRESS)  # where a child server tells its port
    parser.add_argument("--parent_pid", type=int, help=argparse.SUPPRESS)  # exit when this process is gone
    args = parser.parse_args(argv)

    if args.config:
        import yaml

        path = Path(args.config)
        if not path.is_file():
            raise SystemExit(f"gspo serve: error: no config file {path}")
        spec = spec_from_config(yaml.safe_load(path.read_text()) or {})
    else:
        spec = ServerSpec(**json.loads(Path(args.spec).read_text()))
    app = RolloutServer(spec, lease_s=args.lease_s)
    try:
        app.start()
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"gspo serve: error: {error}") from None
    httpd = app.http_server(args.host, args.port)
    port = httpd.server_address[1]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, stop), daemon=True).start()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(f"gspo serve: {spec.model_name_or_path} with {app.identity['engine']} on http://{args.host}:{port} "
          f"(pid {os.getpid()})", flush=True)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.rename(args.port_file)  # whole or absent: the parent never reads half a number
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    httpd.shutdown()
    app.close()


def _watch_parent(pid: int, stop: threading.Event) -> None:
    """A child server ends with the trainer that started it, even one killed without cleanup."""
    while not stop.wait(1.0):
        if os.getppid() != pid:
            stop.set()


def spec_json(spec: ServerSpec) -> str:
    return json.dumps(asdict(spec))


if __name__ == "__main__":
    main(sys.argv[1:])
