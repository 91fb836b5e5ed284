"""State that differs between ranks, in a checkpoint that Lightning writes from rank 0 only.

Each rank samples its own share of the prompts with its own seed, so what it generated
ahead (the asynchronous pipeline's pending rollouts) and its data counters (dynamic
sampling's extra prompt batches) are its own. Lightning calls ``on_save_checkpoint`` on
every rank but writes rank 0's dictionary: :func:`rank_states` collects every rank's
state into it (a collective, on the training thread), and on load each rank takes its own
with :func:`restore_rank_state`. Resuming on another number of ranks is allowed: the
rollouts generated ahead are then sampled again (warned once), nothing is skipped.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch.distributed as dist


def gather_objects(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (a collective); ``[value]`` on one process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        return values
    return [value]


def rank_states(pending_rollouts: Optional[dict[str, Any]], datamodule: Any) -> list[dict[str, Any]]:
    """Every rank's pending rollouts and data module state, in rank order (a collective)."""
    data = datamodule.state_dict() if datamodule is not None else None
    return gather_objects({"pending_rollouts": pending_rollouts, "data": data})


def restore_rank_state(checkpoint: dict[str, Any], rank: int, world_size: int, datamodule: Any) -> Optional[dict[str, Any]]:
    """This rank's pending rollouts from ``checkpoint["gspo"]``; its data module state is put
    where Lightning's ``restore_datamodule`` (which runs after the module's hook) reads it.
    A checkpoint without per-rank states (one rank, older versions) keeps its one state."""
    gspo = checkpoint.get("gspo") or {}
    if "ranks" not in gspo:
        return gspo.get("pending_rollouts")
    states = gspo["ranks"]
    if len(states) == world_size:
        mine = states[rank]
    else:
        if rank == 0:
            warnings.warn(f"the checkpoint was written by {len(states)} rank(s), this run has {world_size}: the rollouts "
                          f"each rank generated ahead are sampled again and rank 0's extra prompt position is used "
                          f"(the prompt shares differ); resume with {len(states)} rank(s) to continue exactly", stacklevel=2)
        mine = {"pending_rollouts": None, "data": states[0]["data"]}
    key = type(datamodule).__qualname__ if datamodule is not None else None
    if key in checkpoint and mine["data"] is not None:
        checkpoint[key] = mine["data"]
    return mine["pending_rollouts"]


__all__ = ["gather_objects", "rank_states", "restore_rank_state"]
