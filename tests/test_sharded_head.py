"""The chunked log-prob path reaches the output head by calling its module, so that a
weight that exists only inside the module's call (DeepSpeed ZeRO-3 partitions, FSDP units)
is gathered; and the DeepSpeed grad norm is the engine's, not 0."""

import copy

import pytest
import torch
from torch import nn

from gspo_lightning.training.logprobs import head_logprobs, response_logprobs


def partition(head: nn.Linear) -> dict:
    """Make ``head`` hold an empty weight except inside its forward and its backward, as
    ZeRO-3 does: a pre-forward hook gathers the weight, a forward hook frees it and hooks the
    outputs so that backward gathers it again. Returns the counts of gathers."""
    full = head.weight.detach().clone()
    counts = {"forward": 0, "backward": 0}

    def gather():
        head.weight.data = full

    def release():
        head.weight.data = torch.empty(0, dtype=full.dtype)

    def pre_forward(module, args):
        counts["forward"] += 1
        gather()

    def post_forward(module, args, output):
        release()
        for out in output if isinstance(output, tuple) else (output,):
            if out.requires_grad:
                out.register_hook(lambda grad: (counts.__setitem__("backward", counts["backward"] + 1), gather())[1])
        return output

    head.register_forward_pre_hook(pre_forward)
    head.register_forward_hook(post_forward)
    release()
    return counts


@pytest.mark.parametrize("chunk_size", [None, 2, 5])
def test_a_partitioned_head_is_gathered_through_its_hooks(chunk_size):
    """Same log-probs, entropies and gradients as an ordinary head, in chunks or not; the
    weight is gathered once per forward and once per backward, not once per chunk."""
    g = torch.Generator().manual_seed(3)
    plain = nn.Linear(8, 13, bias=False)
    hidden = torch.randn(7, 8, generator=g)
    targets = torch.randint(0, 13, (7,), generator=g)
    weights = torch.randn(7, generator=g)
    sharded = copy.deepcopy(plain)
    counts = partition(sharded)

    def run(head):
        h = hidden.clone().requires_grad_(True)
        chunking = {} if chunk_size is None else {"chunk_size": chunk_size}
        lp, ent = head_logprobs(head, h, targets, 0.8, 5, 0.95, **chunking)
        (lp * weights).sum().backward()
        return lp.detach(), ent, h.grad, head.weight.grad

    for a, b in zip(run(sharded), run(plain)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert counts == {"forward": 1, "backward": 1}


def test_response_logprobs_with_a_partitioned_untied_head(tiny_gsm8k):
    """Through the model, chunked (budget 0): the vocabulary size comes from the module, not
    from the (empty) partitioned weight."""
    model, tok = tiny_gsm8k
    model = copy.deepcopy(model)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    reference = copy.deepcopy(model)
    partition(model.lm_head)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, len(tok), (3, 9), generator=g)
    attn = torch.ones_like(ids)

    def run(m):
        m.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(m, ids, attn, 4, chunk_size=4, max_unchunked_bytes=0)
        lp.sum().backward()
        return lp.detach(), ent, m.lm_head.weight.grad, m.get_decoder().layers[0].mlp.up_proj.weight.grad

    for a, b in zip(run(model), run(reference)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
