"""The contract every generation engine follows, and what it returns.

An engine turns prompt token ids into ``n`` sampled responses each, with the log-prob of
every sampled token under the sampling distribution and whether the response hit the
length limit. Engines are components chosen in the config by ``class_path``:

.. code-block:: yaml

    model:
      engine:
        class_path: gspo_lightning.rollout.VLLMEngine
        init_args: {gpu_memory_utilization: 0.3}

The constructor takes only the engine's own knobs (cheap: the config is parsed before
any model exists); :meth:`RolloutEngine.start` receives what the trainer knows, as the
explicit fields of :class:`EngineSpec`. An engine never sees the LightningModule or the
Trainer: new weights arrive as an iterator of ``(name, tensor)`` pairs.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
from torch import Tensor, nn

from gspo_lightning.errors import ConfigError

if TYPE_CHECKING:
    from gspo_lightning.models.lora import LoRA

WeightsIterator = Iterable[tuple[str, Tensor]]  # weights in flight: (name, tensor) pairs, walked once
# the policy's weights, gathered when called: only when a push is due (gathering sharded weights
# is a collective, so every rank calls it or none does)
WeightsSource = Callable[[], WeightsIterator]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding.

    With ``top_k`` / ``top_p`` on, the returned log-probs are taken under the filtered,
    renormalized distribution the token was drawn from (the trainer does the same).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens (response_length) must be >= 1, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")


@dataclass
class Generation:
    """``N = len(prompts) * n`` responses; response ``j`` belongs to prompt ``j // n``.

    Tensors are ``(N, R)`` with ``R`` the longest response, right-padded with ``pad_id``.
    The end-of-sequence token, when sampled, is part of the response (the policy must
    learn to stop) and is counted in ``lengths``.
    """

    completion_ids: Tensor  # (N, R) long
    logprobs: Tensor  # (N, R) float32, 0 at padding
    lengths: Tensor  # (N,) long
    truncated: Tensor  # (N,) bool: reached max_new_tokens without end-of-sequence
    # the policy version that sampled these responses, when the engine knows it (a rollout
    # server reports it); None: the engine's own ``weights_version``
    weights_version: Optional[int] = None

    @property
    def mask(self) -> Tensor:
        positions = torch.arange(self.completion_ids.shape[1], device=self.completion_ids.device)
        return positions[None, :] < self.lengths[:, None]

    @classmethod
    def from_lists(cls, tokens: list[list[int]], logprobs: list[list[float]], truncated: list[bool], pad_token_id: int,
                   weights_version: Optional[int] = None) -> "Generation":
        """Right-padded tensors from one list of token ids (and their log-probs) per response."""
        width = max(len(ids) for ids in tokens)
        completion_ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
        token_logprobs = torch.zeros((len(tokens), width), dtype=torch.float32)
        for row, (ids, lps) in enumerate(zip(tokens, logprobs)):
            completion_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            token_logprobs[row, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
        return cls(completion_ids=completion_ids, logprobs=token_logprobs,
                   lengths=torch.tensor([len(ids) for ids in tokens], dtype=torch.long),
                   truncated=torch.tensor(truncated, dtype=torch.bool), weights_version=weights_version)


@dataclass(frozen=True)
class EngineSpec:
    """What the trainer tells an engine when it starts it.

    ``policy`` is the training model itself, for engines that run in the training process
    and share its weights (the Hugging Face engine); engines with their own copy use it
    only to read the architecture of a model that has no folder (``builtin:`` models).
    ``lockstep(done) -> all_done`` keeps ranks of a sharded policy decoding together.
    """

    model_name_or_path: str
    dtype: str  # float32 | bfloat16 | float16
    prompt_length: Optional[int]  # longest prompt in tokens (data.prompt_length; None: unknown)
    response_length: int  # most new tokens per response
    seed: int
    eos_token_ids: list[int]
    pad_token_id: int
    trust_remote_code: bool = False
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    policy: Optional[nn.Module] = field(default=None, repr=False, compare=False)
    tokenizer: Any = field(default=None, repr=False, compare=False)
    lockstep: Optional[Callable[[bool], bool]] = field(default=None, repr=False, compare=False)
    # the policy's LoRA config (rank, alpha, target modules) when it trains adapters: an engine
    # that serves adapters (``weights_format == "adapter"``) builds its adapter slots from it
    lora: Optional["LoRA"] = None

    @property
    def max_model_len(self) -> Optional[int]:
        """The longest sequence a rollout can make: prompt plus response."""
        return None if self.prompt_length is None else self.prompt_length + self.response_length


def check_lora_sync(engine: str, lora_sync: Optional[str]) -> Optional[str]:
    """An engine's ``lora_sync`` argument, checked when the config is parsed (``engine`` names
    the engine in the error): ``adapter``, ``merged`` or ``None`` (adapter for a LoRA policy)."""
    if lora_sync not in (None, "adapter", "merged"):
        raise ConfigError(f"{engine} lora_sync must be adapter, merged or null (adapter for a LoRA policy), "
                         f"got {lora_sync!r}")
    return lora_sync


def lora_weights_format(engine: str, lora_sync: Optional[str], lora: Optional["LoRA"]) -> str:
    """The ``weights_format`` an engine with ``lora_sync`` takes for a policy whose LoRA config
    is ``lora`` (``EngineSpec.lora``; ``None``: no LoRA): ``adapter`` for a LoRA policy unless
    ``lora_sync`` is ``merged``, else ``full``."""
    if lora_sync == "adapter" and lora is None:
        raise ConfigError(f"{engine} lora_sync: adapter needs a LoRA policy (model.lora); remove lora_sync or set "
                         "model.lora")
    return "adapter" if lora is not None and lora_sync != "merged" else "full"


class RolloutEngine(ABC):
    """Base class of generation engines (``class_path`` in ``model.engine``)."""

    #: True when the engine samples from the training model itself: weights need no push
    shares_policy_weights: bool = False
    #: what :meth:`update_weights` takes, decided at :meth:`start`: ``full`` (every weight under
    #: the base model's names; a LoRA policy's merged) or ``adapter`` (a LoRA policy's
    #: ``lora_A`` / ``lora_B`` alone, PEFT names: ``weight_sync.iter_adapter_weights``)
    weights_format: str = "full"
    #: whether :meth:`generate` takes ``images`` (each prompt's image inputs, ``models/vision.py``)
    takes_images: bool = False
    #: whether :meth:`generate` takes ``affinity`` (one key per prompt: prompts of one key go to
    #: one server, so an episode's turns find its conversation in that server's prefix cache)
    takes_affinity: bool = False

    def __init__(self) -> None:
        self.weights_version = -1  # the policy version whose weights the engine holds

    @abstractmethod
    def start(self, spec: EngineSpec) -> None:
        """Build the engine (load a model, allocate caches). Called once, before any rollout."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams, seed: int) -> Generation:
        """Sample ``n`` responses for each prompt, reproducibly for a given ``seed``.

        An engine whose ``generate`` also takes ``on_group`` calls ``on_group(index, completions)``
        as each group's responses end, so their scoring starts while the rest generate
        (``HFEngine``; ``rollout/scoring.py``)."""

    def update_weights(self, weights: WeightsIterator, version: int) -> dict[str, float]:
        """Load new weights (every pair of ``weights`` must be consumed) and record ``version``.

        Returns sync statistics (``bytes``, ``tensors``). Engines that share the policy's
        weights never get here."""
        raise NotImplementedError(f"{type(self).__name__} cannot load weights")

    def needs_weights(self, version: int) -> bool:
        """Whether the weights of ``version`` must be pushed before the next rollout."""
        return version != self.weights_version

    def sleep(self) -> None:
        """Free generation memory (KV cache, maybe weights) between rollouts."""

    def wake(self) -> None:
        """Undo :meth:`sleep` before the next rollout."""

    def close(self) -> None:
        """Release the engine's resources (end of the run)."""


__all__ = [
    "EngineSpec", "Generation", "RolloutEngine", "SamplingParams", "WeightsIterator", "WeightsSource", "check_lora_sync",
    "lora_weights_format",
]
