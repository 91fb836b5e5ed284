"""Moving the policy's weights into a generation engine, and reading what vLLM generated.

Everything here is free of vLLM, so it is tested in the main environment:

* :func:`iter_policy_weights` is what the trainer hands to an engine: the policy's full
  (unsharded) parameters as ``(hf_name, tensor)`` pairs, whatever strategy holds them.
* :func:`engine_name` maps a training parameter name to the Hugging Face name the engine
  loads (vLLM's loaders take HF checkpoint names).
* :func:`iter_buckets` streams full parameters in buckets of at most ``bucket_bytes``,
  gathering sharded ones (FSDP2 DTensor, DeepSpeed ZeRO-3) one bucket at a time,
  so no rank ever holds a second full copy of the model.
* :func:`outputs_to_generation` turns vLLM ``RequestOutput`` objects into a
  :class:`~gspo_lightning.rollout.engine.Generation`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from gspo_lightning.errors import ConfigError
from gspo_lightning.models.lora import (
    MergedLoRAWeight, adapter_named_weights, base_named_weights, has_lora, merged_named_weights,
)
from gspo_lightning.rollout.engine import Generation

Bucket = list[tuple[str, Tensor]]

# Module names that wrappers insert into parameter names; the engine knows none of them.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def engine_name(name: str) -> str:
    """The checkpoint (HF) name of a training parameter: wrapper segments removed."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    # DDP / DeepSpeed engines put the model under ``module.``; only a leading one is theirs
    while name.startswith("module."):
        name = name[len("module."):]
    return name


# -- sizes and buckets -----------------------------------------------------------------
def is_deepspeed_param(param: Tensor) -> bool:
    """A ZeRO-3 partitioned parameter (its local ``numel()`` is 0, ``ds_numel`` is the full size)."""
    return hasattr(param, "ds_id")


def full_nbytes(param: Tensor) -> int:
    """Bytes of the full parameter, without gathering it."""
    numel = param.ds_numel if is_deepspeed_param(param) else param.numel()  # DTensor.numel() is global
    return int(numel) * param.element_size()


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive index groups whose sizes sum to at most ``bucket_bytes``.

    Order is kept (sharded gathers are collectives: every rank must walk the same order)
    and a tensor larger than the limit gets a bucket of its own.
    """
    if bucket_bytes < 1:
        raise ConfigError(f"bucket size must be >= 1 byte, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, size in enumerate(sizes):
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(index)
        used += size
    if current:
        buckets.append(current)
    return buckets


# -- gathering ---------------------------------------------------------------------------
def sharding_kind(model: nn.Module) -> str:
    """``deepspeed``, ``dtensor`` (FSDP2 / tensor parallel) or ``plain`` (FSDP1 is refused at
    setup: ``training/distributed.py``, ``check_strategy``)."""
    params = list(model.parameters())
    if any(is_deepspeed_param(p) for p in params):
        return "deepspeed"
    if any(hasattr(p, "full_tensor") for p in params):
        return "dtensor"
    return "plain"


def engine_named_shapes(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """The names and full shapes of what an engine receives (a LoRA policy: its base's)."""
    return [(name, value.shape) for name, value in _named_params(model)]


def _named_params(model: nn.Module) -> list[tuple[str, Tensor]]:
    if has_lora(model):  # the base model's names, each LoRA layer's weight merged when read
        return merged_named_weights(model, engine_name)
    return [(engine_name(name), p) for name, p in model.named_parameters()]


def _data(tensor: Tensor) -> Tensor:
    # no autograd history into the engine; a gathered tensor is passed on as is (no new object)
    return tensor.detach() if tensor.requires_grad else tensor


def _read(value, materialize: Callable[[Tensor], Tensor]) -> Tensor:
    return value.materialize(materialize) if isinstance(value, MergedLoRAWeight) else materialize(value)


def _iter_by_size(named: list[tuple[str, Tensor]], bucket_bytes: int,
                  materialize: Callable[[Tensor], Tensor]) -> Iterator[Bucket]:
    for indices in plan_buckets([full_nbytes(p) for _, p in named], bucket_bytes):
        bucket = [(named[i][0], _data(_read(named[i][1], materialize))) for i in indices]
        yield bucket
        del bucket  # gathered copies die before the next bucket is gathered


def _full_tensor(param: Tensor) -> Tensor:
    # FSDP2 / DTensor: an all-gather (a collective: every rank calls it in the same order)
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def _iter_deepspeed(model: nn.Module, bucket_bytes: int) -> Iterator[Bucket]:
    import deepspeed

    named = _named_params(model)
    for indices in plan_buckets([full_nbytes(p) for _, p in named], bucket_bytes):
        params = [named[i][1] for i in indices]
        # modifier_rank=None: read-only gather on every rank, released on exit
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            bucket = [(named[i][0], _data(named[i][1])) for i in indices]
            yield bucket
            del bucket  # our views keep the gathered storage alive past the context otherwise


def iter_buckets(model: nn.Module, bucket_bytes: int) -> Iterator[Bucket]:
    """Full parameters of ``model`` as ``(hf_name, tensor)`` buckets, in a fixed order.

    Tensors of a bucket are only valid until the next one is requested (ZeRO-3 releases
    them). Sharded gathers are collectives: every rank must consume the whole
    iterator. Buffers are not sent: the engine computes its own (rotary tables...).
    """
    if sharding_kind(model) == "deepspeed":
        if has_lora(model):
            raise NotImplementedError("LoRA adapters under deepspeed cannot be merged for the engine here: "
                                      "train LoRA with DDP or FSDP2 (ModelParallelStrategy)")
        return _iter_deepspeed(model, bucket_bytes)
    return _iter_by_size(_named_params(model), bucket_bytes, _full_tensor)


def iter_policy_weights(policy: nn.Module, *, bucket_bytes: int = 256 * 2**20) -> Iterator[tuple[str, Tensor]]:
    """The policy's full weights as ``(hf_name, tensor)`` pairs, whatever holds them.

    Plain and DDP policies hand out their parameters; FSDP2 (DTensor) and ZeRO-3
    shards are gathered ``bucket_bytes`` at a time (collectives: every rank must consume
    the iterator to the end). A pair is valid until the next one of another bucket is
    requested.
    """
    with torch.no_grad():
        for bucket in iter_buckets(policy, bucket_bytes):
            yield from bucket
            del bucket


def _plain_or_dtensor(policy: nn.Module, what: str) -> None:
    kind = sharding_kind(policy)
    if kind not in ("plain", "dtensor"):
        raise NotImplementedError(f"{what} of a LoRA policy under {kind} is not supported here: train LoRA with DDP "
                                  "or FSDP2 (ModelParallelStrategy)")


def engine_weights(policy: nn.Module, weights_format: str) -> Iterator[tuple[str, Tensor]]:
    """What an engine loads: the LoRA adapters alone when it serves them (``weights_format``
    ``adapter``, decided at its start), else the full (for LoRA: merged) weights."""
    if weights_format == "adapter":
        return iter_adapter_weights(policy)
    return iter_policy_weights(policy)


def iter_adapter_weights(policy: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """A LoRA policy's adapters alone, ``(peft_name, tensor)`` (``...q_proj.lora_A.weight``):
    what an engine in ``adapter`` format receives instead of the merged model. FSDP2 shards
    are gathered one tensor at a time (collectives: every rank consumes the iterator)."""
    if not has_lora(policy):
        raise ConfigError("adapter-only weight sync needs a LoRA policy (model.lora)")
    _plain_or_dtensor(policy, "adapter-only weight sync")
    with torch.no_grad():
        for name, param in adapter_named_weights(policy, engine_name):
            yield name, _data(_full_tensor(param))


def iter_base_weights(policy: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """A LoRA policy's frozen base, under the base model's names (no adapter merged): what an
    adapter-serving engine loads once, at start. A policy without LoRA gives its weights."""
    _plain_or_dtensor(policy, "loading the base")
    with torch.no_grad():
        for name, param in base_named_weights(policy, engine_name):
            yield name, _data(_full_tensor(param))


# -- vLLM outputs -> Generation --------------------------------------------------------------
def _sampled_logprob(position: Any, token: int) -> float:
    """The sampled token's log-prob from one position of ``CompletionOutput.logprobs``.

    vLLM gives ``{token_id: Logprob}`` per position (``FlatLogprobs`` indexes the same
    way); with ``logprobs=0`` the sampled token is the only entry.
    """
    if position is None:
        raise ConfigError("vLLM returned no log-probs: request them with SamplingParams(logprobs=0)")
    entry = position[token]
    return float(getattr(entry, "logprob", entry))


def outputs_to_generation(request_outputs: Sequence[Any], n: int, pad_token_id: int) -> Generation:
    """``N = len(request_outputs) * n`` rows, response ``j`` answering prompt ``j // n``.

    A response that stopped on an end-of-sequence token keeps it as its last token
    (vLLM appends the stop token before it checks for a stop). ``truncated`` is
    ``finish_reason == "length"``: ``max_tokens`` or the engine's ``max_model_len``.
    """
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    truncated: list[bool] = []
    for request in request_outputs:
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise ConfigError(f"expected {n} completions per prompt, vLLM returned {len(completions)}")
        for completion in completions:
            reason = completion.finish_reason
            if reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM request {request.request_id} ended with finish_reason={reason!r}")
            ids = [int(t) for t in completion.token_ids]
            if not ids:
                raise RuntimeError(f"vLLM request {request.request_id} returned an empty completion")
            lps = completion.logprobs
            if lps is None or len(lps) != len(ids):
                raise ConfigError("vLLM returned no (or misaligned) log-probs: request them with SamplingParams(logprobs=0)")
            tokens.append(ids)
            logprobs.append([_sampled_logprob(pos, t) for pos, t in zip(lps, ids)])
            truncated.append(reason == "length")
    if not tokens:
        raise ConfigError("no vLLM outputs to convert")
    return Generation.from_lists(tokens, logprobs, truncated, pad_token_id)


__all__ = [
    "engine_name", "full_nbytes", "iter_adapter_weights", "iter_base_weights", "iter_buckets",
    "iter_policy_weights", "outputs_to_generation",
    "plan_buckets", "sharding_kind",
]
