"""The client engine: rollouts from rollout servers (``rollout/server/``), wherever they run.

.. code-block:: yaml

    model:
      engine:
        class_path: gspo_lightning.rollout.RemoteEngine
        init_args:
          urls: [http://gpu-node-1:8000, http://gpu-node-2:8000]   # null: start one here
          transport: {class_path: gspo_lightning.rollout.transport.FolderTransport,
                      init_args: {path: /shared/gspo-weights}}

The trainer does not change: :meth:`generate` spreads the prompts over the servers (whole
groups each), :meth:`update_weights` streams the policy's weights through the transport
(rank 0 writes, every rank consumes the iterator: sharded gathers are collectives) and
checks that every server now holds exactly them (checksum). Every generation is checked
against the version and checksum the trainer pushed, so a server holding other weights
is refused, and its shape against what was asked (``replies.py``). Every request carries
the server's secret, from ``$GSPO_SERVER_TOKEN`` or ``token_file`` (``server/auth.py``);
a server this engine starts gets a fresh one. A server that goes away is waited for with
bounded exponential backoff; one that comes back (restarted) gets the current weights
again; one that does not within ``reconnect_s`` stops the run with
:class:`~gspo_lightning.errors.RolloutServerError`, which writes a checkpoint
(``run/preemption.py``) to resume from.

``generate`` only reads state that ``start`` / ``update_weights`` set, and each call makes
its own connections: it may run in a background thread while the trainer trains.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch

from gspo_lightning.errors import ConfigError, RolloutServerError
from gspo_lightning.rollout.child_server import ChildServer
from gspo_lightning.rollout.engine import (
    EngineSpec, Generation, RolloutEngine, SamplingParams, WeightsIterator, check_lora_sync, lora_weights_format,
)
from gspo_lightning.rollout.replies import check_generation_reply, check_weights_reply
from gspo_lightning.rollout.rank_zero import RankZeroShare
from gspo_lightning.rollout.sampling import server_share_seed
from gspo_lightning.rollout.server.auth import SECRET_ENV, bearer, read_secret
from gspo_lightning.rollout.server.host import DEFAULT_ENGINE, ServerSpec, fingerprint
from gspo_lightning.rollout.transport import FolderTransport, Manifest, WeightTransport, checksum_of
from gspo_lightning.rollout.weight_sync import engine_named_shapes, iter_base_weights

START_HINT = ("start one with `gspo serve --config <your config> --port <port>` (on another machine with "
              f"{SECRET_ENV} set on both sides: docs/scaling.md#security), or set model.engine.init_args.urls: null "
              "to have gspo fit start one on this machine")
SECRET_HINT = (f"set {SECRET_ENV} (or model.engine.init_args.token_file) to the secret the server was started with")


class _Unreachable(Exception):
    """No answer from a server (refused, reset): worth waiting for."""


class _Conflict(Exception):
    """A 409 from a server: ``kind`` is ``session`` or ``version``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def read_bounded(response, max_bytes: int, what: str) -> bytes:
    """A reply's body, refused past ``max_bytes`` (a declared length is checked before reading)."""
    declared = response.headers.get("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise RolloutServerError(f"{what} replied {int(declared)} bytes, above the client's limit of {max_bytes} "
                                 "(model.engine.init_args.max_reply_mb)")
    data = response.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise RolloutServerError(f"{what} replied more than the client's limit of {max_bytes} bytes "
                                 "(model.engine.init_args.max_reply_mb)")
    return data


def request_json(url: str, path: str, body: Optional[dict] = None, timeout: float = 60.0, secret: Optional[str] = None,
                 max_bytes: int = 256 * 2**20) -> Any:
    """One HTTP call (GET without a body, POST with one) with the server's ``secret``; errors
    as the exceptions above. A busy server (503) counts as unreachable: worth waiting for."""
    data = None if body is None else json.dumps(body, allow_nan=False).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json", **bearer(secret)})
    what = f"rollout server {url}{path}"
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = read_bounded(response, max_bytes, what)
        try:
            return json.loads(raw)
        except ValueError:
            raise RolloutServerError(f"{what} replied something that is not JSON: is that a gspo serve?") from None
    except urllib.error.HTTPError as error:
        try:
            payload = json.loads(error.read(1 << 16))
        except ValueError:
            payload = {"error": str(error), "kind": "internal"}
        if not isinstance(payload, dict):
            payload = {"error": str(error), "kind": "internal"}
        if error.code == 409:
            raise _Conflict(payload.get("kind", ""), payload.get("error", "")) from None
        if error.code == 503:
            raise _Unreachable(f"{url}: busy ({payload.get('error')})") from None
        if error.code == 401:
            raise RolloutServerError(f"{what} refused this trainer's secret (401): {SECRET_HINT}") from None
        raise RolloutServerError(f"{what}: {payload.get('error')}") from None
    except TimeoutError:
        raise RolloutServerError(f"rollout server {url}{path} gave no answer within {timeout:.0f} s: "
                                 "raise model.engine.init_args.timeout_s if its generations are that slow") from None
    except (urllib.error.URLError, ConnectionError, OSError) as error:
        if isinstance(getattr(error, "reason", None), TimeoutError):
            raise RolloutServerError(f"rollout server {url}{path} gave no answer within {timeout:.0f} s: "
                                     "raise model.engine.init_args.timeout_s") from None
        raise _Unreachable(f"{url}: {getattr(error, 'reason', error)}") from None


class RemoteEngine(RolloutEngine):
    """Samples on rollout servers over HTTP (``gspo serve``), or on one it starts itself.

    Args:
        urls: the servers (``http://host:port``); prompts are spread over them, whole groups
            per server. ``null``: ``gspo fit`` starts a server on this machine as a child
            process (stopped at the end of the run, and with the trainer if it dies).
        server_engine: the engine a started server hosts, ``{class_path, init_args}``
            (default the Hugging Face engine); ``gspo serve`` reads it from this config too.
        transport: how weights reach the servers (default :class:`FolderTransport` in
            ``/dev/shm``: same machine; across nodes give it a shared ``path``).
        timeout_s: longest wait for one generation or weight load.
        reconnect_s: how long a lost server is waited for (backoff 0.5 s doubling to 4 s)
            before the run stops with a checkpoint.
        start_timeout_s: how long a started server may take to load (vLLM: ~30 s).
        server_threads: CPU threads of a started server (its ``OMP_NUM_THREADS``, pinned to
            the last cores); set the trainer's own on purpose too (docs/scaling.md).
        server_python: the Python that runs a started server (``null``: this one), e.g. a
            virtual environment with vLLM.
        lease_s: a started server lets an idle trainer's hold go after this long.
        token_file: a file holding the servers' secret (``null``: ``$GSPO_SERVER_TOKEN``; a
            started server gets a fresh one when neither is set). Never put the secret itself
            in a config: configs are saved to the run folder.
        max_reply_mb: largest reply read from a server; a larger one stops the run.
        lora_sync: with a LoRA policy, what a push carries: ``adapter`` (the ``lora_A`` /
            ``lora_B`` tensors alone; the servers load the base once, at start, and apply the
            adapters: an HF engine attaches LoRA to its model, vLLM serves a ``LoRARequest``)
            or ``merged`` (the whole merged model under the base's names, every push).
            ``null``: ``adapter`` for a LoRA policy (pushes ~1/30 of the model's bytes).
    """

    shares_policy_weights = False
    is_client = True  # a server cannot host this engine

    def __init__(
        self,
        urls: Optional[list[str]] = None,
        server_engine: Optional[dict[str, Any]] = None,
        transport: Optional[WeightTransport] = None,
        timeout_s: float = 600.0,
        reconnect_s: float = 60.0,
        start_timeout_s: float = 300.0,
        server_threads: int = 1,
        server_python: Optional[str] = None,
        lease_s: float = 120.0,
        token_file: Optional[str] = None,
        max_reply_mb: float = 1024.0,
        lora_sync: Optional[str] = None,
    ):
        super().__init__()
        self.lora_sync = check_lora_sync("RemoteEngine", lora_sync)
        self.adapters: Optional[dict] = None  # the LoRA config the servers serve, in adapter format
        self.base_checksum: Optional[str] = None  # of the policy's frozen base, in adapter format
        for url in urls or []:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"RemoteEngine urls must look like http://host:port, got {url!r}")
        if urls is not None and not urls:
            raise ConfigError("RemoteEngine urls is empty: list the servers, or set urls: null to start one here")
        if timeout_s <= 0 or reconnect_s < 0 or start_timeout_s <= 0:
            raise ConfigError("RemoteEngine timeout_s and start_timeout_s must be > 0, reconnect_s >= 0")
        if server_threads < 1:
            raise ConfigError(f"RemoteEngine server_threads must be >= 1, got {server_threads}")
        if not max_reply_mb > 0:
            raise ConfigError(f"RemoteEngine max_reply_mb must be > 0, got {max_reply_mb}")
        self.urls = list(urls) if urls else None
        self.server_engine = dict(server_engine) if server_engine else None
        self.transport = transport if transport is not None else FolderTransport()
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self.start_timeout_s = start_timeout_s
        self.server_threads = server_threads
        self.server_python = server_python
        self.lease_s = lease_s
        self.token_file = token_file
        self.max_reply_bytes = int(max_reply_mb * 2**20)
        self.secret: Optional[str] = None  # the servers' (auth.py); never logged, never saved
        self.vocab_size = 0
        self.child: Optional[ChildServer] = None
        self.token: Optional[str] = None
        self.rank = 0
        self.world_size = 1
        self.pad_token_id = 0
        self.identity: dict[str, Any] = {}
        self.server_ids: dict[str, str] = {}
        self.pushed: Optional[Manifest] = None  # the last push: re-sent to a restarted server
        self.checksums: dict[int, str] = {}  # recent versions pushed -> checksum of their weights
        self._recovering = threading.Lock()
        self._ranks = RankZeroShare()  # rank 0's outcomes on every rank (several ranks)
        self.last_load_seconds = 0.0

    # -- start ---------------------------------------------------------------------------
    def start(self, spec: EngineSpec) -> None:
        if self.token is not None:
            return
        self.rank, self.world_size, self.pad_token_id = spec.rank, spec.world_size, spec.pad_token_id
        if spec.policy is None:
            raise ConfigError("RemoteEngine checks the servers' model against the policy: EngineSpec.policy must be set")
        self.vocab_size = output_rows(spec.policy)
        self.weights_format = lora_weights_format("RemoteEngine", self.lora_sync, spec.lora)
        adapter = self.weights_format == "adapter"
        self.adapters = spec.lora.serving_config() if adapter else None
        # the server applies adapters to the base it loaded itself: it must be this policy's
        # (every rank computes it: gathering a sharded base is a collective)
        self.base_checksum = checksum_of(iter_base_weights(spec.policy)) if adapter else None
        self.identity = {
            "fingerprint": fingerprint(engine_named_shapes(spec.policy), spec.policy.config.to_dict()),
            "eos_token_ids": sorted(spec.eos_token_ids), "pad_token_id": spec.pad_token_id,
            "model": spec.model_name_or_path,
        }
        urls, secret, failure = self.urls, None, None
        if self.rank == 0:
            try:
                secret = read_secret(self.token_file)
                if urls is None:
                    secret = secret or uuid.uuid4().hex + uuid.uuid4().hex  # a started server's own
                    self.child = ChildServer(self._server_spec(spec), threads=self.server_threads,
                                             python=self.server_python, lease_s=self.lease_s, secret=secret,
                                             weights_root=getattr(self.transport, "path", None))
                    urls = [self.child.start(self.start_timeout_s)]
            except Exception as error:  # noqa: BLE001 - the other ranks wait in share(): tell them
                failure = str(error)
        self._ranks.setup(self.world_size)
        # one session token and secret for the trainer's ranks; the started server's URL for all of them
        urls, token, secret, failure = self._ranks.share((urls, uuid.uuid4().hex, secret, failure))
        if failure:
            raise RolloutServerError(failure)
        self.urls, self.token, self.secret = urls, token, secret
        for url in self.urls:
            info = self._first_contact(url)
            self._check_identity(url, info)
            self._hold(url)
            self.server_ids[url] = info["server_id"]
        self.weights_version = -1  # whatever a server holds, the first rollout pushes the trainer's weights
        atexit.register(self.close)  # the run's end: let the servers go, stop a started one, remove pushed files

    def _server_spec(self, spec: EngineSpec) -> ServerSpec:
        return ServerSpec(
            model_name_or_path=spec.model_name_or_path, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code,
            prompt_length=spec.prompt_length, response_length=spec.response_length, seed=spec.seed,
            engine=self.server_engine or dict(DEFAULT_ENGINE), lora=self.adapters,
        )

    def _call(self, url: str, path: str, body: Optional[dict] = None, timeout: Optional[float] = None) -> Any:
        return request_json(url, path, body, self.timeout_s if timeout is None else timeout, secret=self.secret,
                            max_bytes=self.max_reply_bytes)

    def _first_contact(self, url: str) -> dict:
        try:
            info = self._call(url, "/info", timeout=min(self.timeout_s, 30.0))
        except _Unreachable:
            raise RolloutServerError(f"no rollout server answers at {url}: {START_HINT}") from None
        if not isinstance(info, dict) or not isinstance(info.get("server_id"), str):
            raise RolloutServerError(f"the server at {url} answers /info without a server_id: is it a gspo serve?")
        return info

    def _check_identity(self, url: str, info: dict) -> None:
        mine = self.identity
        for key in ("fingerprint", "eos_token_ids", "pad_token_id"):
            if info.get(key) != mine[key]:
                raise RolloutServerError(
                    f"the rollout server at {url} serves another model ({info.get('model')}, {key} {info.get(key)}) "
                    f"than this run trains ({mine['model']}, {key} {mine[key]}): start it with this run's config")
        if (info.get("adapters") or None) != self.adapters:
            raise RolloutServerError(
                f"the rollout server at {url} serves LoRA adapters {info.get('adapters')}, this run pushes "
                f"{self.adapters or 'full (merged) weights'}: start it with this run's config (model.lora), or set "
                "model.engine.init_args.lora_sync: merged")
        if self.adapters is not None and info.get("base_checksum") != self.base_checksum:
            raise RolloutServerError(
                f"the rollout server at {url} loaded another base model than this run's policy has (checksum "
                f"{str(info.get('base_checksum'))[:12]}, the policy's {self.base_checksum[:12]}; a builtin: model drawn "
                "from another random state?): adapters pushed alone would apply to the wrong weights. Start it on the "
                "same model files and dtype, or set model.engine.init_args.lora_sync: merged")

    def _hold(self, url: str) -> None:
        try:
            self._call(url, "/session", {"token": self.token}, timeout=30.0)
        except _Conflict as error:
            raise RolloutServerError(f"the rollout server at {url} is in use by another trainer: {error}") from None

    # -- weights -------------------------------------------------------------------------
    def update_weights(self, weights: WeightsIterator, version: int) -> dict[str, float]:
        if self.token is None:
            raise RuntimeError("RemoteEngine.update_weights before start()")
        start = time.perf_counter()
        manifest, failure = None, None
        if self.rank == 0:
            try:
                manifest, _ = self.transport.push(weights, version, lambda m: self._post_weights(m, version))
                self.transport.sent(manifest)
            except Exception as error:  # noqa: BLE001 - the other ranks wait in share(): tell them
                failure = error if isinstance(error, RolloutServerError) else f"{type(error).__name__}: {error}"
        else:
            for _ in weights:  # sharded gathers are collectives: every rank walks the whole iterator
                pass
        manifest, failure = self._ranks.share((manifest, str(failure) if failure else None))
        if failure:
            raise RolloutServerError(f"weights push failed: {failure}")
        self.pushed = {"version": version, "manifest": manifest}
        self.checksums = {**{v: c for v, c in self.checksums.items() if v >= version - 8}, version: manifest["checksum"]}
        self.weights_version = version
        return {"bytes": float(manifest["bytes"]), "tensors": float(manifest["tensors"]),
                "seconds": time.perf_counter() - start}

    def _post_weights(self, manifest: Manifest, version: int) -> list[dict]:
        # known before any server holds it: a generation beside this push may come back with it
        self.checksums[version] = manifest["checksum"]
        replies = []
        for url in self.urls:
            reply = self._with_recovery(url, lambda u=url: self._call(
                u, "/weights", {"token": self.token, "version": version, "manifest": manifest}))
            self._check_loaded(url, check_weights_reply(url, reply), version, manifest["checksum"])
            replies.append(reply)
        self.last_load_seconds = max(reply["seconds"] for reply in replies)  # the servers' side of the push
        return replies

    @staticmethod
    def _check_loaded(url: str, reply: dict, version: int, checksum: str) -> None:
        if reply.get("version") != version or reply.get("checksum") != checksum:
            raise RolloutServerError(
                f"the rollout server at {url} does not hold the pushed weights (it reports version {reply.get('version')}, "
                f"checksum {str(reply.get('checksum'))[:12]}; pushed version {version}, checksum {checksum[:12]}): "
                "restart it with this run's config")

    # -- generation ----------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams, seed: int) -> Generation:
        if self.token is None:
            raise RuntimeError("RemoteEngine.generate before start()")
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ConfigError("every prompt needs at least one token")
        version = self.weights_version
        chunks = split_evenly(len(prompt_ids), len(self.urls))
        jobs = [(url, prompt_ids[a:b], server_share_seed(seed, k)) for k, (url, (a, b)) in enumerate(zip(self.urls, chunks)) if b > a]
        if len(jobs) == 1:
            replies = [self._generate_on(*jobs[0], n, params, version)]
        else:
            with ThreadPoolExecutor(len(jobs)) as pool:
                replies = list(pool.map(lambda job: self._generate_on(*job, n, params, version), jobs))
        return replies_to_generation(replies, self.pad_token_id)

    def _generate_on(self, url: str, prompts: list[list[int]], seed: int, n: int, params: SamplingParams,
                     version: int) -> dict:
        """One server's share, sampled with ``version`` or a newer one (pushed meanwhile, when
        ``generate`` runs beside training); the reply's version and checksum are checked."""
        body = {"token": self.token, "prompt_ids": prompts, "n": n, "params": asdict(params), "seed": seed,
                "version": None if version < 0 else version}
        reply = self._with_recovery(url, lambda: self._call(url, "/generate", body))
        check_generation_reply(url, reply, len(prompts) * n, params.max_new_tokens, self.vocab_size)
        if version < 0:
            return reply
        known = reply["version"] in self.checksums
        if not known and (self.rank == 0 or reply["version"] <= version):
            # rank 0 pushed every version there is; another rank may not have heard of the newest yet
            raise RolloutServerError(
                f"rollout refused: the server at {url} generated with version {reply['version']}, which this trainer "
                f"never pushed (its last push is version {version}): another process changed its weights")
        # a version this rank has not heard of yet is newer than its last push: rank 0 just pushed it
        expected = self.checksums.get(reply["version"], reply["checksum"])
        if reply["version"] < version or reply["checksum"] != expected:
            raise RolloutServerError(
                f"rollout refused: the server at {url} generated with version {reply['version']} "
                f"(checksum {str(reply['checksum'])[:12]}), the trainer pushed version {version} "
                f"(checksum {str(self.checksums.get(version))[:12]}): another process changed its weights")
        return reply

    # -- faults --------------------------------------------------------------------------
    def _with_recovery(self, url: str, call: Callable[[], dict]) -> dict:
        """``call()``, waiting out a lost server (backoff) and re-pushing to a restarted one.

        The ``reconnect_s`` budget starts at the first failure, not at the call (which may
        itself wait long, e.g. for a version), and a server that answers again is checked
        (and re-pushed when it restarted) before the run gives up, however long that took."""
        deadline, delay, problem = None, 0.5, None
        while True:
            if problem is None:
                try:
                    return call()
                except _Unreachable as error:
                    problem = f"unreachable ({error})"
                except _Conflict as error:
                    if error.kind == "session":
                        raise RolloutServerError(f"the rollout server at {url} is in use by another trainer: {error}") from None
                    problem = str(error)  # not at the version asked for: restarted, or a push was lost
                deadline = time.monotonic() + self.reconnect_s if deadline is None else deadline
            # the server is checked (and re-pushed when it restarted) before the call is tried again: a
            # restarted server would hold the call for a version it cannot get without the push
            answered = False
            try:
                if self._recover(url):
                    problem = None
                    continue
                answered = True
            except _Unreachable as error:
                problem = f"unreachable ({error})"
            if time.monotonic() >= deadline:
                raise RolloutServerError(f"the rollout server at {url} is {problem}, and did not recover within "
                                         f"{self.reconnect_s:.0f} s (model.engine.init_args.reconnect_s)")
            time.sleep(delay)
            delay = min(2 * delay, 4.0)
            if answered:
                problem = None  # the same server answers again: the call is worth another try

    def _recover(self, url: str) -> bool:
        """A server that answers again: if it restarted, hold it and give it the current weights
        (returns True then)."""
        with self._recovering:
            info = self._call(url, "/info", timeout=30.0)
            if info["server_id"] == self.server_ids.get(url) and (self.pushed is None or info["version"] >= 0):
                return False
            self._check_identity(url, info)
            pushed = self.pushed
            if pushed is not None and not self.transport.resendable:
                raise RolloutServerError(
                    f"the rollout server at {url} restarted, and {type(self.transport).__name__} cannot send it the "
                    f"last push (version {pushed['version']}) again: resume the run from its checkpoint")
            self._hold(url)
            if pushed is not None:
                reply = self._call(url, "/weights", {"token": self.token, **pushed})
                self._check_loaded(url, check_weights_reply(url, reply), pushed["version"], pushed["manifest"]["checksum"])
            self.server_ids[url] = info["server_id"]
            return True

    def close(self) -> None:
        for url in self.urls or []:
            if self.token is not None:
                try:
                    self._call(url, "/session/close", {"token": self.token}, timeout=5.0)
                except (_Unreachable, _Conflict, RolloutServerError):
                    pass
        self.token = None
        if self.child is not None:
            self.child.stop()
            self.child = None
            self.urls = None
        if self.rank == 0:
            self.transport.close()


def output_rows(policy: torch.nn.Module) -> int:
    """How many token ids the policy can sample: its output head's rows (the full count of a
    ZeRO-3 partitioned head, whose local shape is empty), else the config's vocabulary size."""
    head = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
    if head is None:
        return int(policy.config.vocab_size)
    return int(getattr(head.weight, "ds_shape", head.weight.shape)[0])


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, stop)`` ranges over ``count`` items, sizes differing by at most one."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for k in range(parts):
        stop = start + base + (k < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def replies_to_generation(replies: list[dict], pad_token_id: int) -> Generation:
    ids = [row for reply in replies for row in reply["completion_ids"]]
    logprobs = [row for reply in replies for row in reply["logprobs"]]
    truncated = [t for reply in replies for t in reply["truncated"]]
    versions = {reply["version"] for reply in replies}
    # one version: equal by construction (every server is checked)
    return Generation.from_lists(ids, logprobs, truncated, pad_token_id, weights_version=min(versions))


__all__ = ["ChildServer", "RemoteEngine", "output_rows", "replies_to_generation", "request_json", "split_evenly"]
