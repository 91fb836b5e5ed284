"""FSDP2 layout checks on every rank of a gloo world, launched by torchrun from
tests/test_sharding.py; each rank writes ``rank<r>.pt`` with what it measured.

The policy and the reference are sharded by ``GSPOModule.configure_model`` (as
``ModelParallelStrategy`` runs it); an unsharded copy of the same weights is the reference
of every comparison. Each rank works on rows of its own, as data-parallel ranks do.
"""

import argparse
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from gspo_lightning.training import logprobs as logprobs_module
from gspo_lightning.training.distributed import all_ranks_true
from gspo_lightning.training.logprobs import response_logprobs
from gspo_lightning.models.loading import load_policy
from gspo_lightning.training.module import GSPOModule
from gspo_lightning.rollout.engine import EngineSpec, SamplingParams
from gspo_lightning.rollout.hf import HFEngine
from gspo_lightning.rollout.worker import Rollout

MODEL = "builtin:tiny-echo"


class LargestLogits(TorchDispatchMode):
    """The most rows of any ``(rows, vocab)`` tensor an op allocated: the logit buffers."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in inputs:
                continue  # a view (weight.t()) or an in-place op allocates nothing
            if t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


class CountAllGathers:
    """Counts the all-gathers FSDP2 issues (``dist.all_gather_*``)."""

    def __init__(self):
        self.count = 0
        self.saved = {}

    def __enter__(self):
        for name in ("all_gather_single", "all_gather_into_tensor"):
            original = getattr(dist, name)
            self.saved[name] = original

            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def batch(rank: int, vocab: int, rows: int, prompt: int, response: int):
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :2] = 0  # a shorter, left-padded prompt
    attn[1, prompt + response - 2:] = 0  # a shorter response
    return ids, attn, prompt


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    out = {"world": world}

    module = GSPOModule(model_name_or_path=MODEL, use_kl_loss=True, temperature=0.8, top_k=5, logprob_chunk_size=3)
    torch.manual_seed(0)
    plain = load_policy(MODEL, module.tokenizer).train()
    module._device_mesh = mesh
    torch.manual_seed(0)
    module.configure_model()
    policy, reference = module.policy, module.reference
    vocab = plain.config.vocab_size
    out["same_weights"] = all(torch.equal(full(p), q) for p, q in zip(policy.parameters(), plain.parameters()))

    # the reference: sharded like the policy, half of every parameter on each rank
    ref_params = list(reference.parameters())
    out["reference_all_dtensor"] = all(hasattr(p, "to_local") for p in ref_params)
    out["reference_local_fraction"] = sum(local(p).numel() for p in ref_params) / sum(p.numel() for p in ref_params)
    out["reference_shares_policy_storage"] = any(
        local(p).data_ptr() == local(q).data_ptr() for p, q in zip(ref_params, policy.parameters()))

    # generation: same samples as the unsharded engine; all-gathers per call independent of length
    eos = [module.tokenizer.eos_token_id]
    prompts = [[3, 4 + rank, 5], [6, 7, 8 + rank, 9]]
    gathers, same = {}, True
    for length in (3, 9):
        engine, unsharded = HFEngine(), HFEngine()
        for e, model in ((engine, policy), (unsharded, plain)):
            e.start(EngineSpec(model_name_or_path=MODEL, dtype="float32", prompt_length=4, response_length=length, seed=0,
                               eos_token_ids=eos, pad_token_id=module.tokenizer.pad_token_id, rank=rank, world_size=world,
                               policy=model, tokenizer=module.tokenizer,
                               lockstep=(lambda done: all_ranks_true(done, torch.device("cpu"))) if model is policy else None))
        params = SamplingParams(max_new_tokens=length, temperature=1.0)
        with CountAllGathers() as counter:
            sharded_out = engine.generate(prompts, 3, params, seed=11 + rank)
        plain_out = unsharded.generate(prompts, 3, params, seed=11 + rank)
        gathers[length] = counter.count
        same &= torch.equal(sharded_out.completion_ids, plain_out.completion_ids)
        same &= torch.allclose(sharded_out.logprobs, plain_out.logprobs, atol=1e-5)
        out[f"generated_tokens_{length}"] = int(sharded_out.lengths.sum())
    out["generation_all_gathers"] = gathers
    out["generation_same_samples"] = bool(same)

    # log-probs and gradients through the chunked path: equal to the unsharded model's
    ids, attn, prompt = batch(rank, vocab, rows=4, prompt=4, response=7)
    weights = torch.randn(ids.shape[0], ids.shape[1] - prompt, generator=torch.Generator().manual_seed(7 + rank))
    calls = {"lean": 0}
    lean = logprobs_module._HeadLogprobs.apply

    def counted(*a):
        calls["lean"] += 1
        return lean(*a)

    logprobs_module._HeadLogprobs.apply = counted
    try:
        rollout = Rollout(ids, attn, prompt, attn[:, prompt:].bool(), torch.zeros_like(weights), torch.zeros(4), {},
                          torch.zeros(4, dtype=torch.bool), group_size=2, policy_version=0, prompts=[], completions=[])
        module._logprobs(policy, rollout, torch.arange(4))
        out["module_takes_the_head_path"] = calls["lean"] > 0
        largest = {}
        for chunk, budget in ((3, 0), (None, 0)):
            policy.zero_grad(set_to_none=True)
            with LargestLogits(vocab) as spy:
                lp, ent = response_logprobs(policy, ids, attn, prompt, temperature=0.8, top_k=5, chunk_size=chunk,
                                            max_unchunked_bytes=budget)
                (lp * weights).sum().backward()
            largest["chunked" if chunk else "full"] = spy.rows
            if chunk:
                out["logprobs"], out["entropy"] = lp.detach(), ent.detach()
                # FSDP2 averages gradients over ranks
                out["grads"] = {n: full(p.grad) for n, p in policy.named_parameters()}
        out["largest_logit_rows"] = largest
        with torch.no_grad():
            out["reference_logprobs"] = response_logprobs(reference, ids, attn, prompt, temperature=0.8, top_k=5,
                                                          chunk_size=3, max_unchunked_bytes=0)[0]
    finally:
        logprobs_module._HeadLogprobs.apply = lean

    # the unsharded model on every rank's rows: the expected values and the averaged gradient
    expected_grads = {n: torch.zeros_like(p) for n, p in plain.named_parameters()}
    for r in range(world):
        ids_r, attn_r, _ = batch(r, vocab, rows=4, prompt=4, response=7)
        w_r = torch.randn(ids_r.shape[0], ids_r.shape[1] - prompt, generator=torch.Generator().manual_seed(7 + r))
        plain.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(plain, ids_r, attn_r, prompt, temperature=0.8, top_k=5, chunk_size=None)
        (lp * w_r).sum().backward()
        for n, p in plain.named_parameters():
            expected_grads[n] += p.grad / world
        if r == rank:
            out["expected_logprobs"], out["expected_entropy"] = lp.detach(), ent.detach()
    out["expected_grads"] = expected_grads
    torch.save(out, os.path.join(args.out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
