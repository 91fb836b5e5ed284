"""The vLLM engine: a colocated ``vllm.LLM`` on every training rank (written for vLLM 0.32).

Each rank runs its own in-process engine on its own GPU (``external_launcher``, as
vLLM's verl integration does); with ``tensor_parallel_size > 1`` consecutive ranks share
one tensor-parallel engine and generate their prompts together. The engine runs in the
training process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weights move from the policy
to vLLM as plain tensors on the same GPU, bucket by bucket (``weight_sync.py``).

Nothing here imports vLLM at module import time: ``import gspo_lightning`` and the CPU
tests never need it. See ``docs/vllm.md`` for memory planning and log-prob semantics.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import sys
import tempfile
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from gspo_lightning.rollout.engine import Generation, SamplingParams
from gspo_lightning.rollout.weight_sync import Bucket, WeightSync, fsdp1_class, outputs_to_generation

INSTALL_HINT = "pip install 'gspo-lightning[vllm]' (vllm 0.32.0, torch 2.13.0) on a Linux machine with an NVIDIA GPU"
SEED_MODULUS = 2**62  # vLLM keeps seeds in int64 and adds the sample index to them
SLEEP_TAGS = ("kv_cache", "weights")


# -- start-up checks ---------------------------------------------------------------------
def _vllm_installed() -> bool:
    if "vllm" in sys.modules:  # None there means "import blocked" (tests do this)
        return sys.modules["vllm"] is not None
    return importlib.util.find_spec("vllm") is not None


def check_vllm_available() -> None:
    """Fail early, saying what is missing, instead of deep inside vLLM."""
    problems = []
    if not torch.cuda.is_available():
        problems.append(
            f"no CUDA GPU is visible (torch {torch.__version__}: torch.cuda.is_available() is False); "
            "vLLM only runs on NVIDIA GPUs. On this machine use engine: hf"
        )
    if not _vllm_installed():
        problems.append(f"vLLM is not installed; install it with: {INSTALL_HINT}")
    if problems:
        raise RuntimeError("engine=vllm cannot start:\n  - " + "\n  - ".join(problems))


# -- small pure pieces -----------------------------------------------------------------------
def choose_logprobs_mode(temperature: float, top_k: int, top_p: float) -> tuple[str, Optional[str]]:
    """vLLM's ``logprobs_mode`` closest to the trainer's log-probs, and the gap if any.

    The trainer scores tokens with ``log_softmax(logits / temperature)`` over the full
    vocabulary. vLLM 0.32 offers ``raw_logprobs`` (``log_softmax(logits)``: no temperature)
    or ``processed_logprobs`` (after temperature *and* top-k/top-p, renormalized over the
    kept tokens). One of them is exact unless temperature != 1 and a filter is on.
    """
    if top_k == 0 and top_p >= 1.0:
        return "processed_logprobs", None
    if temperature == 1.0:
        return "raw_logprobs", None
    return "processed_logprobs", (
        f"with temperature={temperature} and top_k={top_k} / top_p={top_p}, vLLM's log-probs are renormalized "
        "over the top-k/top-p tokens, so they are higher than the trainer's full-vocabulary log-probs by "
        "-log(kept probability mass). Keep old_logprobs: recompute (the default), or turn the filters off"
    )


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
        seed=seed,  # vLLM gives sample j of the prompt seed + j
        detokenize=False,  # we decode ourselves; the engine has no tokenizer
    )


def request_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """One seed per prompt, spaced by ``n`` so that no two samples share a seed."""
    return [(seed + i * n) % SEED_MODULUS for i in range(num_prompts)]


def infer_max_model_len(module) -> Optional[int]:
    """``data.prompt_length + model.response_length`` when a data module says its prompt length."""
    trainer = getattr(module, "_trainer", None)
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    hparams = getattr(datamodule, "hparams", None)
    prompt_length = hparams.get("prompt_length") if hasattr(hparams, "get") else None
    if prompt_length is None:
        prompt_length = getattr(datamodule, "prompt_length", None)
    if prompt_length is None:
        return None
    return int(prompt_length) + int(module.hparams.response_length)


def tensor_parallel_groups(world_size: int, tp: int) -> list[list[int]]:
    """Consecutive ranks, the layout vLLM gives its own tensor-parallel groups."""
    if tp < 1 or world_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the number of training processes ({world_size})")
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


def launcher_env(rank: int, local_rank: int, world_size: int, environ=os.environ) -> dict[str, str]:
    """Environment vLLM's ``external_launcher`` reads (torchrun's variables)."""
    env = {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: weights pass as tensors
    }
    if "MASTER_ADDR" not in environ:
        env["MASTER_ADDR"] = "127.0.0.1"
    if "MASTER_PORT" not in environ:  # only read when torch.distributed is not initialized yet
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
    return env


def save_engine_checkpoint(policy: nn.Module, tokenizer, out_dir: str | Path) -> Path:
    """Config, generation config and tokenizer of ``policy``, without weights.

    vLLM builds its model from a folder; a ``builtin:`` model has none. The engine starts
    from ``load_format="dummy"`` weights and the first sync (always made: the engine's
    version starts at -1) loads the policy's, so sharded policies are never saved whole.
    """
    out = Path(out_dir)
    policy.config.save_pretrained(out)
    generation_config = getattr(policy, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def fsdp1_root(module, policy: nn.Module) -> Optional[nn.Module]:
    """Lightning's FSDP1 wrapper (``strategy.model``) when it wraps the module around ``policy``.

    ``FSDPStrategy`` wraps the whole LightningModule, so the policy's embeddings and final
    norm belong to a unit above the policy: the sync must summon them through this root.
    """
    trainer = getattr(module, "_trainer", None)
    root = getattr(getattr(trainer, "strategy", None), "model", None)
    fsdp = fsdp1_class()
    if fsdp is None or root is None or root is policy or not isinstance(root, fsdp):
        return None
    return root


def _load_bucket(bucket: Bucket, model: nn.Module) -> None:
    # runs inside vLLM's worker (this process): HF names, vLLM shards / fuses them
    model.load_weights(bucket)


# -- the engine -----------------------------------------------------------------------------
class VLLMEngine:
    """Samples with a colocated ``vllm.LLM``; see :meth:`from_module` for the options."""

    def __init__(
        self,
        llm,
        eos_token_ids: list[int],
        pad_token_id: int,
        *,
        weight_sync_bucket_mb: float = 256,
        sleep_level: int = 0,
        load_mode: str = "direct",
        tp_group=None,
        sampling_params_cls=None,
        checkpoint_dir=None,
        module=None,
    ):
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level must be 0 (off), 1 (offload weights) or 2 (discard weights), got {sleep_level}")
        if load_mode not in ("direct", "reload"):
            raise ValueError(f"load_mode must be 'direct' or 'reload', got {load_mode!r}")
        if not hasattr(llm.llm_engine, "model_executor"):
            raise RuntimeError("the vLLM engine core runs in another process, so weights cannot be loaded in place: "
                               "set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the LLM")
        self.llm = llm
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.sleep_level = sleep_level
        self.load_mode = load_mode
        self.tp_group = tp_group
        self._sampling_params_cls = sampling_params_cls
        self._checkpoint_dir = checkpoint_dir  # a TemporaryDirectory for builtin models, kept alive
        self._module = module  # the LightningModule, to find an FSDP1 root around the policy
        self._sync = WeightSync(int(weight_sync_bucket_mb * 2**20))
        self._sleeping: set[str] = set()
        self.sleep()  # free the KV cache until the first rollout (no-op without sleep mode)

    @property
    def weights_version(self) -> int:
        return self._sync.version

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_module(cls, module, eos_token_ids: list[int], **engine_kwargs) -> "VLLMEngine":
        """Build the engine for a ``GSPOModule`` (``model.engine_kwargs`` in the config).

        Our keys: ``gpu_memory_utilization`` (default 0.3: the share of the whole GPU vLLM
        may take for weights, activations and KV cache), ``weight_sync_bucket_mb`` (256),
        ``sleep_level`` (0 off; 1 or 2 sleep between rollouts), ``tensor_parallel_size``
        (1), ``max_model_len`` (default: data.prompt_length + response_length), ``dtype``
        (default: model.dtype), ``logprobs_mode`` (default: chosen from the sampling
        settings), ``load_mode`` (``direct``: ``model.load_weights`` per bucket; ``reload``:
        vLLM's ``reload_weights``, for models whose layers post-process weights). Every other
        key goes to ``vllm.LLM`` unchanged (``enforce_eager``, ``max_num_seqs``, ...).
        """
        check_vllm_available()
        from gspo_lightning.tasks import is_builtin

        kwargs = dict(engine_kwargs)
        engine_options = {
            "weight_sync_bucket_mb": kwargs.pop("weight_sync_bucket_mb", 256),
            "sleep_level": int(kwargs.pop("sleep_level", 0) or 0),
            "load_mode": kwargs.pop("load_mode", "direct"),
        }
        hp = module.hparams
        tp = int(kwargs.pop("tensor_parallel_size", 1))
        trainer = getattr(module, "_trainer", None)
        rank, local_rank, world_size = 0, 0, 1
        if trainer is not None:
            rank, local_rank, world_size = trainer.global_rank, trainer.local_rank, trainer.world_size
        groups = tensor_parallel_groups(world_size, tp)
        if world_size > 1 and not torch.distributed.is_initialized():
            raise RuntimeError("engine=vllm with several processes needs torch.distributed initialized "
                               "(a Lightning strategy)")

        if "logprobs_mode" not in kwargs:
            kwargs["logprobs_mode"], gap = choose_logprobs_mode(hp.temperature, hp.top_k, hp.top_p)
            if gap:
                warnings.warn(f"vLLM log-probs differ from the trainer's: {gap}", stacklevel=2)
        if kwargs.get("max_model_len") is None:
            kwargs["max_model_len"] = infer_max_model_len(module)
            if kwargs["max_model_len"] is None:
                del kwargs["max_model_len"]  # vLLM's default: the model's context length
                warnings.warn("engine=vllm: max_model_len unknown (no data.prompt_length); vLLM will plan its KV cache "
                              "for the model's full context. Set model.engine_kwargs.max_model_len", stacklevel=2)

        checkpoint_dir = None
        model_path = hp.model_name_or_path
        if is_builtin(model_path):
            checkpoint_dir = tempfile.TemporaryDirectory(prefix="gspo-vllm-")
            model_path = str(save_engine_checkpoint(module.policy, module.tokenizer, checkpoint_dir.name))
            kwargs.setdefault("load_format", "dummy")

        os.environ.update(launcher_env(rank, local_rank, world_size))  # before vLLM reads its environment
        vllm = importlib.import_module("vllm")
        base_seed = getattr(hp, "rollout_seed", None)
        if base_seed is None:
            base_seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        llm_kwargs = dict(
            model=model_path,
            dtype=hp.dtype,
            gpu_memory_utilization=0.3,
            tensor_parallel_size=tp,
            distributed_executor_backend="external_launcher",  # one engine per rank, GPU = LOCAL_RANK
            enable_sleep_mode=engine_options["sleep_level"] > 0,
            skip_tokenizer_init=True,  # token ids in, token ids out
            trust_remote_code=bool(getattr(hp, "trust_remote_code", False)),
            seed=base_seed + rank // tp,  # identical inside a tensor-parallel group
        )
        llm_kwargs.update(kwargs)
        llm = vllm.LLM(**llm_kwargs)

        tp_group = None
        if tp > 1:
            # gloo: the group only exchanges prompt lists (Python objects)
            tp_group, _ = torch.distributed.new_subgroups_by_enumeration(groups, backend="gloo")
        return cls(llm, eos_token_ids, module.tokenizer.pad_token_id, tp_group=tp_group,
                   sampling_params_cls=vllm.SamplingParams, checkpoint_dir=checkpoint_dir, module=module,
                   **engine_options)

    # -- the protocol -----------------------------------------------------------------------
    def update_weights(self, policy: nn.Module, version: int) -> Optional[dict[str, float]]:
        if not self._sync.needs_sync(version):
            return None
        if "weights" in self._sleeping:  # wake only the weights; the KV cache stays freed
            self.llm.wake_up(tags=["weights"])
            self._sleeping.discard("weights")
        root = fsdp1_root(self._module, policy) if self._module is not None else None
        stats = self._sync.sync(policy, version, self._load, root=root)
        if not self._sleeping:  # sleeping (level >= 1) already dropped the prefix cache
            self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        return stats

    def _load(self, buckets) -> None:
        if self.load_mode == "reload":
            # one pass through vLLM's in-place reload, which re-runs weight post-processing
            pairs = (pair for bucket in buckets for pair in bucket)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True})
        else:
            for bucket in buckets:
                self.llm.apply_model(partial(_load_bucket, bucket))
                del bucket  # dropped before the next bucket is gathered

    def sleep(self) -> None:
        if not self.sleep_level or self._sleeping:
            return
        self.llm.sleep(level=self.sleep_level)
        self._sleeping = set(SLEEP_TAGS)
        if self.sleep_level >= 2:
            self._sync.invalidate()  # level 2 discards the weights: the next update must resend them

    def wake(self) -> None:
        if self._sleeping:
            self.llm.wake_up(tags=sorted(self._sleeping))
            self._sleeping.clear()

    def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams, seed: int) -> Generation:
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        self.wake()
        prompts, start = prompt_ids, 0
        if self.tp_group is not None:
            prompts, start, seed = self._gather_group_prompts(prompt_ids, seed)
        sampling_cls = self._sampling_params_cls or importlib.import_module("vllm").SamplingParams
        sampling = [sampling_cls(**sampling_kwargs(params, n, self.eos_token_ids, s))
                    for s in request_seeds(seed, len(prompts), n)]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)
        generation = outputs_to_generation(outputs, n, self.pad_token_id)
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


__all__ = ["VLLMEngine", "check_vllm_available", "choose_logprobs_mode", "request_seeds", "sampling_kwargs"]
