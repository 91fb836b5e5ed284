"""The protocol every generation engine follows, and what it returns.

An engine turns prompt token ids into ``n`` sampled responses each, with the log-prob of
every sampled token under the (temperature-scaled) sampling distribution and whether the
response hit the length limit. The Hugging Face engine (``hf.py``) runs anywhere; the
vLLM engine (``vllm.py``) is for GPUs. Both receive weights through ``update_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens (response_length) must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")


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

    @property
    def mask(self) -> Tensor:
        positions = torch.arange(self.completion_ids.shape[1], device=self.completion_ids.device)
        return positions[None, :] < self.lengths[:, None]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout callback needs from a generation engine."""

    #: the policy version whose weights the engine holds (-1 before the first sync)
    weights_version: int

    def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams, seed: int) -> Generation:
        """Sample ``n`` responses for each prompt, reproducibly for a given ``seed``."""
        ...

    def update_weights(self, policy: nn.Module, version: int) -> Optional[dict[str, float]]:
        """Load ``policy``'s weights if ``version`` differs from ``weights_version``.

        Returns sync statistics (seconds, bytes) when a sync happened, else ``None``."""
        ...

    def sleep(self) -> None:
        """Free generation memory (KV cache, maybe weights) between rollouts."""
        ...

    def wake(self) -> None:
        """Undo :meth:`sleep` before the next rollout."""
        ...
