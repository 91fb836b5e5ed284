"""Rollouts on stock vLLM servers (``vllm serve`` processes the user started), through vLLM's own
OpenAI and RL routes: nothing of ours runs beside them.

- Generation: ``POST /v1/completions`` with the prompt as token ids, ``n`` samples, a seed, and
  ``return_token_ids`` + ``logprobs: 0``: each sample's token ids and the log-prob of each
  sampled token, as the server sampled it (start it with ``--logprobs-mode processed_logprobs``
  so those are the log-probs of the distribution it sampled from, temperature and top-p applied,
  which is what the trainer computes). No text goes through a tokenizer.
- Weights (vLLM's RL API, ``VLLM_SERVER_DEV_MODE=1``): the policy's weights are written once as a
  safetensors folder the servers read (``weights_dir``: on this machine, ``/dev/shm`` by default),
  then on every replica ``/pause?mode=wait`` (the running requests finish), ``/collective_rpc``
  ``reload_weights`` from that folder, ``/update_weight_version``, ``/reset_prefix_cache`` (cached
  prefixes were computed with the old weights) and ``/resume``. A LoRA policy's adapters alone
  instead: a PEFT folder per version, ``/v1/load_lora_adapter`` under a new name that generations
  then name as their model, the last one unloaded.
- Replicas: each prompt's whole group goes to one replica (its prompt is cached once), prompts
  spread over the replicas in turn; every turn of an episode (multi-turn, an agent's calls) goes
  to its group's replica, where its conversation so far is cached; control calls go to every
  replica. Behind a router (``router_url``: vllm-router), generations go to the router with an
  ``X-Session-ID`` per group or episode, which a sticky policy keeps on one replica; control
  calls still go to each replica.
- ``gspo serve`` answers the same routes (``rollout/server/vllm_api.py``; the HF engine, for
  machines without vLLM): its ``/v1/models`` says so, and it then gets a replica's prompts in
  one request, which its engine batches (vLLM batches separate requests itself). Its key is
  the server's secret: ``api_key_env: GSPO_SERVER_TOKEN``.

vLLM authenticates only its OpenAI routes (``--api-key``); its dev-mode routes take any caller:
keep the servers on 127.0.0.1 or a private interface (docs/vllm.md).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from gspo_lightning.errors import ConfigError
from gspo_lightning.rollout.engine import (
    EngineSpec, Generation, RolloutEngine, SamplingParams, WeightsIterator, check_lora_sync, lora_weights_format,
)
from gspo_lightning.rollout.rank_zero import RankZeroShare
from gspo_lightning.rollout.stock_launch import StockServers
from gspo_lightning.rollout.transport import OWN_ROOT_PREFIX, remove_dead_runs_folders
from gspo_lightning.rollout.sampling import server_share_seed
from gspo_lightning.rollout.server.vllm_api import OWNER as GSPO_SERVE_OWNER
from gspo_lightning.rollout.vllm import lora_slot_rank, request_seeds
from gspo_lightning.rollout.weight_sync import engine_name, iter_base_weights, iter_policy_weights

START_COMMAND = ("VLLM_SERVER_DEV_MODE=1 VLLM_API_KEY=KEY python -m vllm.entrypoints.openai.api_server --model DIR "
                 "--logprobs-mode processed_logprobs --no-enable-chunked-prefill --host 127.0.0.1 --port PORT "
                 "(docs/vllm.md)")


def tied_aliases(policy) -> dict[str, str]:
    """``{alias: name}`` of parameters the model shares (tied embeddings: ``lm_head.weight`` is
    ``model.embed_tokens.weight``), by their checkpoint names. The trainer sends each shared
    tensor once; vLLM's folder reload does not keep a tie (the output layer kept its old values
    when only the embeddings came), so the engine writes each alias too."""
    if policy is None:
        return {}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in policy.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[engine_name(name)] = first[id(param)]
        else:
            first[id(param)] = engine_name(name)
    return aliases


class StockServerError(RuntimeError):
    """A stock vLLM server refused or failed a call; the message names the server and the route."""


class StockVLLMEngine(RolloutEngine):
    """Samples on stock vLLM servers (``model.engine``): running ones, or ones it starts here.

    Args:
        base_urls: the servers, e.g. ``[http://127.0.0.1:8000]`` (each started with the command
            in docs/vllm.md, serving the run's model). ``null`` with ``launch``.
        api_key_env: the environment variable that holds the servers' key (``VLLM_API_KEY``, which
            vLLM reads as ``--api-key``; a key is never written in a config; unset: no key is sent).
        weights_dir: where each update's safetensors folder is written for the servers to read
            (a path they see; default ``/dev/shm`` where it exists: memory, not disk).
        timeout_s: the longest wait for one call (a generation, a weights reload).
        max_reply_mb: the largest reply read from a server.
        launch: start this many servers on this machine instead (127.0.0.1, free ports, a key drawn
            for the run, docs/vllm.md's flags), stopped with the run; ``0``: use ``base_urls``.
        launch_threads: CPU threads of each started server, on cores of its own.
        launch_args: more ``vllm serve`` flags for the started servers.
        launch_timeout_s: how long a started server may take to answer.
        router_url: a router in front of the replicas (``vllm-router --policy consistent_hash
            --worker-urls <base_urls>``): generations go there, one request per prompt (per key on
            ``gspo serve`` replicas), each with an ``X-Session-ID`` header naming its group or
            episode, so a sticky policy keeps a group and every call of an episode on one replica.
            Control calls (pause, weights, resume) still go to each of ``base_urls``: a router
            sends those to one replica only. ``null``: the engine spreads the prompts itself.
        lora_sync: with a LoRA policy (``model.lora``), what an update carries. ``adapter`` (the
            default for a LoRA policy): the servers hold the frozen base, and each version arrives
            as a PEFT adapter folder loaded through ``/v1/load_lora_adapter`` (start them with
            ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``;
            ``launch`` does); generations name it as their model. ``merged``: the whole model with
            the adapters merged, reloaded every update (``gspo serve`` replicas take only this).
    """

    def __init__(self, base_urls: Optional[list[str]] = None, api_key_env: str = "VLLM_API_KEY",
                 weights_dir: Optional[str] = None, timeout_s: float = 600.0, max_reply_mb: int = 256, launch: int = 0,
                 launch_threads: int = 1, launch_args: Optional[list[str]] = None, launch_timeout_s: float = 600.0,
                 lora_sync: Optional[str] = None, router_url: Optional[str] = None):
        super().__init__()
        check_lora_sync("StockVLLMEngine", lora_sync)
        self.lora_sync = lora_sync
        self.lora = None  # the policy's LoRA config when updates are adapters
        self._adapter: Optional[str] = None  # the adapter generations name (None: the base model)
        if bool(base_urls) == bool(launch):
            raise ConfigError("StockVLLMEngine needs either base_urls (the vLLM servers to sample on, e.g. "
                              f"[http://127.0.0.1:8000]; start one with {START_COMMAND}) or launch: N (this run "
                              f"starts N servers here), not {'both' if base_urls else 'neither'}")
        if launch < 0 or launch_threads < 1 or not launch_timeout_s > 0:
            raise ConfigError(f"StockVLLMEngine launch must be >= 0, launch_threads >= 1 and launch_timeout_s > 0, got "
                              f"{launch}, {launch_threads}, {launch_timeout_s}")
        base_urls = list(base_urls or [])
        bad = [url for url in base_urls if not str(url).startswith(("http://", "https://"))]
        if bad:
            raise ConfigError(f"StockVLLMEngine base_urls must be http(s) URLs, got {bad}")
        if router_url is not None and not str(router_url).startswith(("http://", "https://")):
            raise ConfigError(f"StockVLLMEngine router_url must be an http(s) URL, got {router_url!r}")
        if router_url is not None and launch:
            raise ConfigError("StockVLLMEngine router_url fronts servers you started (base_urls): with launch, the "
                              "engine spreads the prompts over the servers it starts; leave router_url unset")
        if not timeout_s > 0 or max_reply_mb < 1:
            raise ConfigError(f"StockVLLMEngine timeout_s must be > 0 and max_reply_mb >= 1, got {timeout_s}, {max_reply_mb}")
        self.urls = [str(url).rstrip("/").removesuffix("/v1") for url in base_urls]
        self.router = None if router_url is None else str(router_url).rstrip("/").removesuffix("/v1")
        self._session_tag = secrets.token_hex(4)  # a run's own session ids: runs sharing a router do not collide
        self.launch, self.launch_threads, self.launch_args = launch, launch_threads, list(launch_args or [])
        self.launch_timeout_s = launch_timeout_s
        self._servers: Optional[StockServers] = None
        self._key: Optional[str] = None  # the key of the servers this run started (else the variable's)
        self.api_key_env = api_key_env
        self.weights_dir = weights_dir
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_mb * 2**20
        self.model: Optional[str] = None
        self.pad_token_id = 0
        self._folder: Optional[Path] = None
        self.aliases: dict[str, str] = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self.batching: set[str] = set()  # replicas that take several prompts per request (gspo serve)
        self.rank = 0
        self._ranks = RankZeroShare()
        self._failed: set[str] = set()  # servers a call failed on (a started one's log is kept)

    # -- calls -----------------------------------------------------------------------------
    def _call(self, url: str, path: str, body: Optional[dict] = None, *, method: Optional[str] = None,
              timeout: Optional[float] = None, session: Optional[str] = None) -> Any:
        key = self._key or (os.environ.get(self.api_key_env) if self.api_key_env else None)
        data = None if body is None else json.dumps(body, allow_nan=False).encode()
        request = urllib.request.Request(url + path, data=data, method=method or ("GET" if body is None else "POST"),
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {key}"} if key else {}),
                                                  **({"X-Session-ID": session} if session else {})})
        where = f"{'router' if url == self.router else 'vLLM server'} {url}{path.split('?')[0]}"
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout_s) as response:
                raw = response.read(self.max_reply_bytes + 1)
        except urllib.error.HTTPError as error:
            detail = error.read(2000).decode(errors="replace").strip()
            if error.code >= 500:
                self._failed.add(url)  # a started server's log is kept at close
            if error.code == 401:
                raise StockServerError(f"{where} refused the key (401): set {self.api_key_env} to the key the server "
                                       "was started with (--api-key)") from None
            if error.code == 404 and path.split("?")[0] in ("/is_paused", "/pause", "/collective_rpc"):
                raise StockServerError(f"{where} is not served (404): start vLLM with VLLM_SERVER_DEV_MODE=1, which "
                                       "serves its RL routes (pause, weights)") from None
            if error.code == 404 and path.startswith("/v1/load_lora_adapter"):
                raise StockServerError(f"{where} is not served (404): start vLLM with --enable-lora --max-lora-rank R "
                                       "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (or set lora_sync: merged)") from None
            raise StockServerError(f"{where} answered {error.code}: {detail[:600]}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
            self._failed.add(url)
            reason = getattr(error, "reason", error)
            raise StockServerError(f"{where}: no answer ({reason}); is it running? start it with {START_COMMAND}") from None
        if len(raw) > self.max_reply_bytes:
            raise StockServerError(f"{where} replied more than {self.max_reply_bytes} bytes "
                                   "(model.engine.init_args.max_reply_mb)")
        if path.startswith(("/v1/load_lora_adapter", "/v1/unload_lora_adapter")):
            return {"reply": raw.decode(errors="replace")}  # vLLM answers these in plain text
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            raise StockServerError(f"{where} replied something that is not JSON: is that a vLLM server?") from None

    def _each(self, path: str, body: Optional[dict] = None) -> list[Any]:
        """The same call on every replica, side by side."""
        return list(self._pool.map(lambda url: self._call(url, path, body), self.urls))

    # -- the contract ----------------------------------------------------------------------
    def start(self, spec: EngineSpec) -> None:
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="gspo-stock-vllm")
        self.pad_token_id = spec.pad_token_id
        self.eos_token_ids = list(spec.eos_token_ids)
        self.aliases = tied_aliases(spec.policy)
        self.rank = spec.rank
        self.weights_format = lora_weights_format("StockVLLMEngine", self.lora_sync, spec.lora)
        self.lora = spec.lora if self.weights_format == "adapter" else None
        if self.launch and not Path(spec.model_name_or_path).is_dir() and (spec.policy is None or spec.tokenizer is None):
            raise ConfigError(f"StockVLLMEngine launch needs the policy and tokenizer to write {spec.model_name_or_path} "
                              "as a folder")
        # several ranks: rank 0 starts the servers and reloads their weights; each rank samples its own prompts
        failure = None
        if self.rank == 0:
            root = Path(self.weights_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))
            root.mkdir(parents=True, exist_ok=True)
            # the pid in the name: a later run removes this folder if this one is killed (its weights sit in RAM)
            remove_dead_runs_folders(root)
            self._folder = Path(tempfile.mkdtemp(prefix=f"{OWN_ROOT_PREFIX}{os.getpid()}-", dir=root))
            if self.launch:
                try:
                    self._launch(spec)
                except Exception as error:  # noqa: BLE001 - the other ranks wait in share(): tell them
                    failure = error
        elif self.launch and not Path(spec.model_name_or_path).is_dir() and spec.policy is not None:
            base = iter_base_weights(spec.policy) if self.lora is not None else iter_policy_weights(spec.policy)
            for _ in base:  # rank 0 writes them: a sharded gather is a collective
                pass
        self._ranks.setup(spec.world_size)
        self.urls, self._key, message = self._ranks.share((self.urls, self._key, str(failure) if failure else None))
        if failure is not None:
            raise failure
        if message:
            raise StockServerError(f"rank 0 could not start the vLLM servers: {message}")
        names = []
        for url in self.urls:
            # the base model: a server may list adapters too (a resumed run's), each with its parent
            models = [m for m in self._call(url, "/v1/models").get("data") or [] if not m.get("parent")]
            if len(models) != 1:
                raise StockServerError(f"vLLM server {url} serves {len(models)} models; serve the run's model alone")
            model = models[0]
            longest = model.get("max_model_len")
            if spec.max_model_len is not None and longest is not None and longest < spec.max_model_len:
                raise ConfigError(f"vLLM server {url} takes sequences up to {longest} tokens, and the run needs "
                                  f"{spec.max_model_len} (data.prompt_length + model.rollout.response_length): "
                                  f"restart it with --max-model-len {spec.max_model_len}")
            self._call(url, "/is_paused")  # the RL routes are there (VLLM_SERVER_DEV_MODE=1)
            names.append(model["id"])
            # gspo serve (vllm_api.py) takes a replica's prompts in one request: its HF engine batches
            # them, and one seed per request keeps them reproducible; vLLM gets one request per prompt
            if model.get("owned_by") == GSPO_SERVE_OWNER:
                self.batching.add(url)
        if len(set(names)) != 1:
            raise ConfigError(f"the vLLM servers serve different models {names}: serve the same model on each")
        if self.router is not None:  # it forwards to one of the replicas
            routed = [m.get("id") for m in self._call(self.router, "/v1/models").get("data") or [] if not m.get("parent")]
            if routed != names[:1]:
                raise ConfigError(f"the router {self.router} serves {routed}, not the replicas' model {names[0]!r}: put "
                                  f"it in front of the base_urls' servers (vllm-router --worker-urls ...)")
        if self.lora is not None and self.batching:
            raise ConfigError(f"gspo serve ({sorted(self.batching)[0]}) loads no LoRA adapters through vLLM's routes: set "
                              "model.engine.init_args.lora_sync: merged (the merged weights reloaded whole)")
        self.model = names[0]

    def _launch(self, spec: EngineSpec) -> None:
        """Start ``launch`` servers of the run's model: its folder as it is, or (a ``builtin:`` model,
        a hub id) the policy written as one, as each update writes it (the first rollout pushes the
        current weights anyway)."""
        model_dir = spec.model_name_or_path
        if not Path(model_dir).is_dir():
            folder = self._folder / "model"
            folder.mkdir()
            spec.policy.config.save_pretrained(folder)
            spec.tokenizer.save_pretrained(folder)
            # adapters apply to the frozen base; the merged weights otherwise (the first update pushes them anyway)
            self._write_weights(iter_base_weights(spec.policy) if self.lora is not None else iter_policy_weights(spec.policy),
                                folder)
            model_dir = str(folder)
        self._key = secrets.token_hex(16)
        args, env = list(self.launch_args), {}
        if self.lora is not None:  # one adapter at a time: the current version's
            args += ["--enable-lora", "--max-lora-rank", str(lora_slot_rank(self.lora.rank)), "--max-loras", "1"]
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        self._servers = StockServers(self.launch, self.launch_threads, args, extra_env=env)
        self.urls = self._servers.start(model_dir, self._key, spec.dtype, spec.max_model_len, self.launch_timeout_s)

    def _write_weights(self, weights: WeightsIterator, folder: Path) -> tuple[int, int]:
        """``weights`` as one safetensors file in ``folder`` (tied tensors under each name); ``(bytes, tensors)``
        of the weights given (an alias's copy is not counted)."""
        from safetensors.torch import save_file

        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in weights}
        size, count = sum(t.numel() * t.element_size() for t in tensors.values()), len(tensors)  # the policy's own
        for alias, name in self.aliases.items():  # a copy: safetensors refuses two names on one storage
            if alias not in tensors and name in tensors:
                tensors[alias] = tensors[name].clone()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return size, count

    takes_affinity = True

    def _write_adapter(self, weights: WeightsIterator, folder: Path) -> tuple[int, int]:
        """The adapter tensors as a PEFT folder (what ``/v1/load_lora_adapter`` reads); ``(bytes, tensors)``."""
        from gspo_lightning.models.lora import write_adapter_folder

        tensors = [(name, tensor.detach().to("cpu")) for name, tensor in weights]
        write_adapter_folder(tensors, folder, self.lora)
        return sum(t.numel() * t.element_size() for _, t in tensors), len(tensors)

    def _swap_adapter(self, name: str, folder: Path) -> None:
        """Load adapter ``name`` on every replica, then unload the last one (generations name the new one;
        vLLM caches an adapter by name, so every version gets its own)."""
        previous, self._adapter = self._adapter, None  # a failed load leaves no adapter claimed
        self._each("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        self._adapter = name
        if previous is not None:
            self._each("/v1/unload_lora_adapter", {"lora_name": previous})

    def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams, seed: int,
                 affinity: Optional[list[int]] = None) -> Generation:
        """``affinity``: a key per prompt (an episode's group); prompts of one key go to one replica,
        each turn of an episode to the replica that holds its conversation so far. Default: the
        prompt's index, so the prompts of a step spread over the replicas in turn."""
        if self.model is None:
            raise RuntimeError("StockVLLMEngine.generate before start()")
        seeds = request_seeds(seed, len(prompt_ids), n)
        body = {"model": self._adapter or self.model, "n": n, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                "top_p": params.top_p, "top_k": params.top_k, "logprobs": 0, "return_token_ids": True,
                # every EOS the trainer knows of, and only those (as the other engines stop)
                "stop_token_ids": self.eos_token_ids, "ignore_eos": True, "skip_special_tokens": False}

        def request(url: str, prompts: list[int] | list[list[int]], request_seed: int, count: int,
                    session: Optional[str]) -> list[dict]:
            reply = self._call(url, "/v1/completions", {**body, "prompt": prompts, "seed": request_seed}, session=session)
            choices = sorted(reply.get("choices") or [], key=lambda c: c.get("index", 0))
            if len(choices) != count * n:
                raise StockServerError(f"vLLM server {url} returned {len(choices)} samples for {count} prompt(s), "
                                       f"not {count * n}")
            return choices

        # the whole group of a prompt on one replica (its prompt cached once), prompts in turn
        keys = list(range(len(prompt_ids))) if affinity is None else list(affinity)
        if len(keys) != len(prompt_ids):
            raise ValueError(f"affinity has {len(keys)} keys for {len(prompt_ids)} prompts")
        calls, order = [], []
        if self.router is not None:  # the router places each request by its session id
            batching = self.batching == set(self.urls)  # gspo serve replicas: a key's prompts in one request
            by_key: dict[int, list[int]] = {}
            for i, key in enumerate(keys):
                by_key.setdefault(key, []).append(i)
            for key, mine in by_key.items():
                session = f"{self._session_tag}-{key}"
                if batching:
                    calls.append((self.router, [prompt_ids[i] for i in mine], server_share_seed(seed, key), len(mine), session))
                else:
                    calls.extend((self.router, prompt_ids[i], seeds[i], 1, session) for i in mine)
                order.extend(mine)
        else:
            for k, url in enumerate(self.urls):
                mine = [i for i, key in enumerate(keys) if key % len(self.urls) == k]
                if not mine:
                    continue
                if url in self.batching:
                    calls.append((url, [prompt_ids[i] for i in mine], server_share_seed(seed, k), len(mine), None))
                else:
                    calls.extend((url, prompt_ids[i], seeds[i], 1, None) for i in mine)
                order.extend(mine)
        replies = list(self._pool.map(lambda call: request(*call), calls))
        by_prompt: dict[int, list[dict]] = {}
        position = iter(order)
        for choices in replies:
            for start in range(0, len(choices), n):
                by_prompt[next(position)] = choices[start:start + n]

        tokens, logprobs, truncated = [], [], []
        for index in range(len(prompt_ids)):
            for choice in by_prompt[index]:
                ids = choice.get("token_ids")
                values = (choice.get("logprobs") or {}).get("token_logprobs")
                if ids is None or values is None or len(values) != len(ids):
                    raise StockServerError("a vLLM server returned a sample without its token ids and log-probs: "
                                           "is it vLLM 0.32 or newer?")
                tokens.append(ids)
                logprobs.append([float(v) for v in values])
                truncated.append(choice.get("finish_reason") == "length")
        return Generation.from_lists([ids or [self.pad_token_id] for ids in tokens], logprobs, truncated,
                                     self.pad_token_id, weights_version=self.weights_version)

    def update_weights(self, weights: WeightsIterator, version: int) -> dict[str, float]:
        if self.model is None:
            raise RuntimeError("StockVLLMEngine.update_weights before start()")
        start = time.perf_counter()
        report, failure = {}, None
        if self.rank == 0:
            try:
                report = self._reload(weights, version)
            except Exception as error:  # noqa: BLE001 - the other ranks wait in share(): tell them
                failure = error
        else:
            for _ in weights:  # sharded gathers are collectives: every rank walks the whole iterator
                pass
        # every rank waits here for rank 0's reload: no rank samples from the old weights after it
        # the adapter generations now name, too: rank 0 loaded it, every rank samples from it
        report, self._adapter, message = self._ranks.share((report, self._adapter, str(failure) if failure else None))
        if failure is not None:
            raise failure
        if message:
            raise StockServerError(f"rank 0's weights reload failed: {message}")
        self.weights_version = version
        return {**report, "seconds": time.perf_counter() - start}

    def _reload(self, weights: WeightsIterator, version: int) -> dict[str, float]:
        start = time.perf_counter()
        # a fresh folder per version: a server never reads a half-written file of the next one
        folder = self._folder / f"v{version}"
        if self.lora is not None:
            size, count = self._write_adapter(weights, folder)
        else:
            folder.mkdir()
            size, count = self._write_weights(weights, folder)
        written = time.perf_counter()
        self._each("/pause?mode=wait", {})
        try:
            if self.lora is not None:
                self._swap_adapter(f"policy-v{version}", folder)
            else:
                self._each("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
                self._each("/reset_prefix_cache", {})  # cached prefixes were computed with the old weights
            self._each("/update_weight_version", {"new_version": str(version)})
        finally:
            self._each("/resume", {})
        for old in self._folder.iterdir():
            if old != folder and old.name != "model":  # the started servers' model folder stays
                shutil.rmtree(old, ignore_errors=True)
        return {"bytes": float(size), "tensors": float(count), "write_seconds": written - start}

    def close(self) -> None:
        if self._servers is not None:
            self._servers.stop(failed=tuple(i for i, url in enumerate(self.urls) if url in self._failed))
            self._servers = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


__all__ = ["StockServerError", "StockVLLMEngine"]
