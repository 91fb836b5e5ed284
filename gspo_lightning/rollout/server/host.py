"""Hosting an engine: :class:`RolloutServer` starts the engine a :class:`ServerSpec` names on
its model, reports the model's identity, loads pushed weights and generates, and says which
weights version (and checksum) every reply was made with.

Generation and weight loads take one lock: a push waits for the generation in flight, and a
generation never sees two versions. Who may ask is the lease's business (``lease.py``); how
requests arrive, the HTTP layer's (``http.py``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from gspo_lightning._imports import import_object
from gspo_lightning.errors import ConfigError
from gspo_lightning.models.lora import adapter_param_name
from gspo_lightning.rollout.engine import EngineSpec, RolloutEngine, SamplingParams
from gspo_lightning.rollout.server.lease import SessionLease
from gspo_lightning.rollout.server.limits import ServerLimits
from gspo_lightning.rollout.transport import RECEIVERS, WeightsChecksum, WeightTransport, default_weights_root

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
    # the trainer's LoRA config (``LoRA.serving_config()``: rank, alpha, target_modules) when it
    # pushes adapters alone; None: pushes are full weights under the base model's names
    lora: Optional[dict] = None


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
    cls = import_object(class_path, "server engine")
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise ConfigError(f"server engine {class_path!r} is not a gspo_lightning RolloutEngine")
    if getattr(cls, "is_client", False):
        raise ConfigError(f"a rollout server cannot host {cls.__name__}, the client engine: give it a generating engine "
                         "(gspo_lightning.rollout.HFEngine or VLLMEngine)")
    return cls(**dict(engine.get("init_args") or {}))


class RolloutServer:
    """An engine, its model identity, the weights version it serves, and who holds it.

    Args:
        spec: the model and engine to serve.
        lease_s: a trainer idle this long loses its hold (a crashed trainer frees the server).
        version_wait_s: how long a generation waits for the weights version it asks for
            (ranks of one trainer ask for the version rank 0 is pushing).
        limits: what one request may ask (``limits.py``; the HTTP layer reads its own there).
        weights_root: the only folder under which pushed weight folders are read
            (``None``: ``/dev/shm``, else the temporary directory, where a trainer's
            ``FolderTransport`` without a path writes).
    """

    def __init__(self, spec: ServerSpec, lease_s: float = 120.0, version_wait_s: float = 120.0,
                 limits: Optional[ServerLimits] = None, weights_root: Optional[str] = None):
        self.spec = spec
        self.lease = SessionLease(lease_s)
        self.version_wait_s = version_wait_s
        self.limits = limits or ServerLimits()
        self.weights_root = str(weights_root or default_weights_root())
        # the receiving side of each transport, for one session: a NCCL communicator joins one trainer
        self._receivers: dict[str, WeightTransport] = {}
        self._receivers_session: Optional[str] = None
        self.vocab_size = 0
        self.engine = build_engine(spec.engine)
        self.server_id = uuid.uuid4().hex
        self.version = -1
        self.checksum: Optional[str] = None
        self.condition = threading.Condition()  # held by a generation or a weight load
        self.paused = False  # vLLM's /pause: generations wait until /resume
        self.tokenizer = None
        self.identity: dict[str, Any] = {}
        self._param_name = lambda name: name  # pushed name -> the held model's parameter (start() sets it)

    # -- start ---------------------------------------------------------------------------
    def start(self) -> None:
        from gspo_lightning.models.loading import eos_token_ids, load_policy, load_tokenizer

        spec = self.spec
        tokenizer = load_tokenizer(spec.model_name_or_path, spec.trust_remote_code)
        model = load_policy(spec.model_name_or_path, tokenizer, spec.dtype, None, spec.trust_remote_code)
        # eval, but weights left as the trainer's policy has them (requiring grad; generation runs
        # without autograd, so no gradient is ever kept): on some CPUs (AVX-512, MKL) the output
        # head's matmul over the prompt's last position dispatches to mm or bmm by that flag, and
        # the two round differently, so a frozen copy sampled ~1e-7 apart from the colocated engine
        model.eval()
        model.config.use_cache = False
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        eos = eos_token_ids(model, tokenizer)
        self.tokenizer = tokenizer
        fingerprint_ = model_fingerprint(model)  # of the base: what the trainer's LoRA policy reports too
        lora, base_checksum = None, None
        if spec.lora is not None:
            from gspo_lightning.models.lora import LoRA, attach_lora
            from gspo_lightning.rollout.transport import checksum_of

            lora = LoRA(**spec.lora)
            # adapters apply to the base this server loaded: the trainer checks it holds the same one
            base_checksum = checksum_of((name, p.detach()) for name, p in model.named_parameters())
            if self.engine.shares_policy_weights:  # the engine samples from this model: pushes land in its adapters
                model = attach_lora(model, lora)
        self._param_name = adapter_param_name if lora is not None else (lambda name: name)
        self.identity = {
            "model": spec.model_name_or_path, "architecture": type(model).__name__,
            "fingerprint": fingerprint_, "adapters": spec.lora, "base_checksum": base_checksum,
            "eos_token_ids": sorted(eos), "pad_token_id": tokenizer.pad_token_id, "dtype": spec.dtype,
            "engine": f"{type(self.engine).__module__}.{type(self.engine).__qualname__}",
            "max_new_tokens": self.limits.max_new_tokens or spec.response_length,
        }
        self.engine.start(EngineSpec(
            model_name_or_path=spec.model_name_or_path, dtype=spec.dtype, prompt_length=spec.prompt_length,
            response_length=spec.response_length, seed=spec.seed, eos_token_ids=eos,
            pad_token_id=tokenizer.pad_token_id, trust_remote_code=spec.trust_remote_code,
            policy=model, tokenizer=tokenizer, lora=lora,
        ))
        if lora is not None and not self.engine.shares_policy_weights and self.engine.weights_format != "adapter":
            raise ConfigError(f"the server engine {self.identity['engine']} does not serve LoRA adapters, and the trainer "
                             "pushes them (spec.lora): host an engine that does (HFEngine, VLLMEngine) or have the trainer "
                             "push merged weights (model.engine.init_args.lora_sync: merged)")
        # the model the engine samples from, to read its weights back after a load (HF engines);
        # None for engines that keep their own (vLLM): their checksum is of what they received
        held = getattr(self.engine, "model", None)
        self.held_model: Optional[nn.Module] = held if isinstance(held, nn.Module) else None

    def info(self) -> dict:
        return {**self.identity, "server_id": self.server_id, "version": self.version, "checksum": self.checksum,
                "session": self.lease.held()}

    # -- weights -------------------------------------------------------------------------
    def _receiver(self, kind: Any, token: str) -> WeightTransport:
        """The receiving side of transport ``kind`` for the session ``token`` (hold the condition)."""
        if kind not in RECEIVERS:
            raise ConfigError(f"unknown weight transport {str(kind)[:40]!r}; this server reads {sorted(RECEIVERS)}")
        if token != self._receivers_session:  # another trainer: nothing of the last one's is reused
            for receiver in self._receivers.values():
                receiver.close()
            self._receivers, self._receivers_session = {}, token
        if kind not in self._receivers:
            self._receivers[kind] = RECEIVERS[kind].receiver(self.weights_root)
        return self._receivers[kind]

    def load(self, token: str, version: int, manifest: dict) -> dict:
        self.lease.hold(token)
        start = time.perf_counter()
        with self.condition:
            # a manifest the transport refuses (a folder outside the weights root...) changes nothing
            stream = self._receiver(manifest.get("kind"), token).receive(manifest)
            received = self._load_stream(stream, int(version))
            if received.hexdigest() != manifest.get("checksum"):
                self.checksum = None  # no version, no claim about what is held
                raise ConfigError("the weights read differ from what the trainer sent (checksum): a partial or stale "
                                 f"weights folder at {str(manifest.get('path'))[:200]}")
            self.version = int(version)
            self.condition.notify_all()
        self.lease.hold(token)
        return {"version": self.version, "checksum": self.checksum, "seconds": time.perf_counter() - start,
                "tensors": received.tensors, "bytes": received.bytes}

    def _load_stream(self, stream: Iterator[tuple[str, Tensor]], version: int) -> WeightsChecksum:
        """Load ``stream`` into the engine (hold the condition); the checksum of what was read.
        The version is -1 until the caller sets it (a load that fails half-way leaves none), and
        the checksum is of the weights then held (else of what was read)."""
        received = WeightsChecksum()
        dtypes: dict[str, torch.dtype] = {}

        def pairs() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in stream:
                received.update(name, tensor)
                dtypes[name] = tensor.dtype
                yield name, tensor

        self.version, self.checksum = -1, None
        self._load_pairs(pairs(), version)
        self.checksum = self._held_checksum(list(dtypes), dtypes) or received.hexdigest()
        return received

    def _load_pairs(self, pairs: Iterator[tuple[str, Tensor]], version: int) -> None:
        if not self.engine.shares_policy_weights:
            self.engine.update_weights(pairs, version)
            return
        # the engine samples from the server's model: copy into its parameters
        # every name of a shared tensor (a folder written for vLLM holds the tied head as well)
        params = dict(self.held_model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in pairs:
                target = params.get(self._param_name(name))
                if target is None or target.shape != tensor.shape:
                    raise ConfigError(f"pushed weight {name!r} {tuple(tensor.shape)} does not fit this server's model "
                                     f"{self.spec.model_name_or_path} ({'missing' if target is None else tuple(target.shape)})")
                target.copy_(tensor)

    def _held_checksum(self, names: list[str], dtypes: dict[str, torch.dtype]) -> Optional[str]:
        """The checksum of the weights the engine now holds, when it can be read back in the
        dtypes that were sent (else ``None``: the checksum of what was received stands)."""
        if self.held_model is None:
            return None
        params = dict(self.held_model.named_parameters(remove_duplicate=False))
        held = {name: params.get(self._param_name(name)) for name in names}
        if any(held[name] is None or held[name].dtype != dtypes[name] for name in names):
            return None
        total = WeightsChecksum()
        for name in names:
            total.update(name, held[name])
        return total.hexdigest()

    # -- generation ----------------------------------------------------------------------
    def generate(self, token: str, prompt_ids: list[list[int]], n: int, params: SamplingParams, seed: int,
                 version: Optional[int]) -> dict:
        """Responses to ``prompt_ids`` (checked by ``limits.generation_request`` when they come
        over HTTP)."""
        self.lease.hold(token)
        generation, served, checksum = self.sample(prompt_ids, n, params, seed, version)
        self.lease.hold(token)
        lengths = generation.lengths.tolist()
        return {
            "completion_ids": [row[:k] for row, k in zip(generation.completion_ids.tolist(), lengths)],
            "logprobs": [row[:k] for row, k in zip(generation.logprobs.tolist(), lengths)],
            "truncated": generation.truncated.tolist(), "version": served, "checksum": checksum,
        }

    def sample(self, prompt_ids: list[list[int]], n: int, params: SamplingParams, seed: int,
               version: Optional[int] = None):
        """``(generation, version, checksum)``: the engine's samples, once the server serves
        ``version`` or newer (when given) and is not paused, each waited for up to
        ``version_wait_s``."""
        deadline = time.monotonic() + self.version_wait_s
        with self.condition:
            # a newer version is fine (a trainer that pushed while this request was on its way)
            while (self.paused or (version is not None and self.version < version)) and time.monotonic() < deadline:
                self.condition.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            if self.paused:
                raise VersionError(f"the server stayed paused (POST /pause) for {self.version_wait_s:.0f} s: resume it "
                                   "with POST /resume")
            if version is not None and self.version < version:
                raise VersionError(f"the server serves weights version {self.version}, the request asks for {version} or newer")
            self.engine.wake()
            try:
                generation = self.engine.generate(prompt_ids, n, params, seed)
            finally:
                self.engine.sleep()
            return generation, self.version, self.checksum

    # -- vLLM's RL routes (``vllm_api.py``): pause, a weights folder, the version ----------------
    def pause(self) -> None:
        """Stop new generations; returns once the one in flight (if any) has ended."""
        with self.condition:
            self.paused = True

    def resume(self) -> None:
        with self.condition:
            self.paused = False
            self.condition.notify_all()

    def reload_folder(self, path: str) -> dict:
        """Load every tensor of the safetensors files in ``path`` (a folder under the weights
        root, written by this server's user; vLLM's ``reload_weights``). The version becomes
        ``-1`` until ``set_version``: the served weights are no version a client asked for."""
        from gspo_lightning.rollout.transport import read_safetensors_folder

        start = time.perf_counter()
        with self.condition:
            stream = read_safetensors_folder(self.weights_root, path)  # refused before anything changes
            received = self._load_stream(stream, -1)
        return {"seconds": time.perf_counter() - start, "tensors": received.tensors, "bytes": received.bytes}

    def set_version(self, version: int) -> None:
        with self.condition:
            self.version = int(version)
            self.condition.notify_all()

    def close(self) -> None:
        for receiver in self._receivers.values():
            receiver.close()
        self.engine.close()


def spec_json(spec: ServerSpec) -> str:
    """The spec as JSON: what ``gspo fit`` writes for the server it starts (``gspo serve --spec``)."""
    return json.dumps(asdict(spec))


__all__ = ["DEFAULT_ENGINE", "RolloutServer", "ServerSpec", "VersionError", "build_engine", "fingerprint", "model_fingerprint",
           "spec_json"]
