"""How new weights travel from the trainer to an engine.

Colocated engines (the Hugging Face engine, an in-process vLLM) take the ``(name,
tensor)`` iterator in this process. An engine in another process or on other machines
would add a transport here (NCCL broadcast, shared memory) whose far side turns what it
receives back into the same iterator for :meth:`RolloutEngine.update_weights`.
"""

from __future__ import annotations

import time

from gspo_lightning.rollout.engine import RolloutEngine, WeightsIterator


class InProcessTransport:
    """Hands the weights iterator to an engine that lives in the training process."""

    def send(self, engine: RolloutEngine, weights: WeightsIterator, version: int) -> dict[str, float]:
        start = time.perf_counter()
        stats = dict(engine.update_weights(weights, version) or {})
        stats["seconds"] = time.perf_counter() - start
        return stats


__all__ = ["InProcessTransport"]
