"""FSDP2 layout of a causal LM, for ``ModelParallelStrategy``: the policy and its frozen
reference are sharded the same way, over the data-parallel mesh.

Units (``fully_shard`` groups): every decoder layer; the input embeddings and the output
head (one unit when their weights are tied, else two); and the decoder itself, which holds
the final norm and is the root of every forward. Nothing is left to the model's own root,
so the decoder and the head can be called separately, as the chunked log-prob path does
(``training/logprobs.py``): each call's FSDP hooks gather what it needs. A model with parameters
outside its decoder and head gets a root unit instead, and must take the full-logit path.

Generation with the Hugging Face engine gathers every unit once per ``generate`` call
(:func:`~gspo_lightning.rollout.hf.gathered`, defined with the engine that calls it, so that
rollout/ imports nothing from training/), not once per decoded token.
"""

from __future__ import annotations

from torch import nn



def data_parallel_mesh(mesh):
    """The ``data_parallel`` dimension of Lightning's mesh, or the mesh itself."""
    return mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh


def fully_shard_causal_lm(model: nn.Module, mesh) -> bool:
    """Shard ``model`` in place; returns whether its decoder and head may be called
    separately (the chunked log-prob path)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    decoder = model.get_decoder()
    # explicit reshard_after_forward everywhere: a unit that becomes a root keeps it too
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is embed.weight:
        fully_shard([embed, head], mesh=mesh, reshard_after_forward=True)  # a tied weight lives in one unit
    else:
        fully_shard(embed, mesh=mesh, reshard_after_forward=True)
        if head is not None:
            fully_shard(head, mesh=mesh, reshard_after_forward=True)
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True)
    if all(isinstance(p, DTensor) for p in model.parameters()):
        return head is not None
    fully_shard(model, mesh=mesh, reshard_after_forward=True)  # the rest; forwards must start at the root
    return False


__all__ = ["data_parallel_mesh", "fully_shard_causal_lm"]
