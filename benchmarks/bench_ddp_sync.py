"""DDP gradient sync: the module's former scheme (DDP's reducer off, one bucketed all-reduce
after the last micro-batch, ``manual_sum`` below) against DDP's reducer overlapping the last
micro-batch's backward (``no_sync`` on the others), which the module uses now
(``distributed.GradientSync``). Both sum the same gradients.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_ddp_sync.py --steps 5

Rank 0 prints one JSON line: per-step seconds of each scheme (alternating, same inputs) and
their median ratio. CPU / gloo; a ~25M-parameter Llama (hidden 512, 8 layers, vocab 2000).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

BUCKET_BYTES = 64 * 2**20


def build_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=2000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def micro_loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def manual_sum(params) -> None:
    """Sum gradients over ranks in flat buckets of ``BUCKET_BYTES``, after the last backward."""
    params = [p for p in params if p.requires_grad]
    for p in params:  # a parameter unused on one rank (an idle expert) must still join the sum
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket, size = [], 0
    for grad in [p.grad for p in params] + [None]:
        if grad is not None:
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
        if bucket and (grad is None or size >= BUCKET_BYTES):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for g, synced in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(synced.view_as(g))
            bucket, size = [], 0


def step_manual(model, batches):
    for ids in batches:
        micro_loss(model, ids).backward()
    manual_sum(model.parameters())


def step_reducer(ddp: DDP, batches):
    for i, ids in enumerate(batches):
        if i < len(batches) - 1:
            with ddp.no_sync():
                micro_loss(ddp, ids).backward()
        else:
            micro_loss(ddp, ids).backward()  # the reducer all-reduces buckets as backward fills them


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro_batches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    manual_model = build_model(0)
    reducer_model = build_model(0)
    ddp = DDP(reducer_model)
    params = sum(p.numel() for p in manual_model.parameters())
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, 2000, (args.rows, args.tokens), generator=g) for _ in range(args.micro_batches)]

    times = {"manual": [], "reducer": []}
    for step in range(args.steps + 1):  # step 0 warms up both
        for name in ("manual", "reducer") if step % 2 == 0 else ("reducer", "manual"):
            model = manual_model if name == "manual" else reducer_model
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            step_manual(manual_model, batches) if name == "manual" else step_reducer(ddp, batches)
            dist.barrier()
            if step:
                times[name].append(time.perf_counter() - start)
    # the same gradient: DDP averages over ranks, the manual scheme sums
    diff = max((a.grad / dist.get_world_size() - b.grad).abs().max().item()
               for a, b in zip(manual_model.parameters(), reducer_model.parameters()))
    if rank == 0:
        ratios = [m / r for m, r in zip(times["manual"], times["reducer"])]
        print(json.dumps({
            "params_M": round(params / 1e6, 1), "world": dist.get_world_size(), "micro_batches": args.micro_batches,
            "tokens_per_micro_batch": args.rows * args.tokens, "threads": args.threads,
            "manual_s": [round(t, 3) for t in times["manual"]], "reducer_s": [round(t, 3) for t in times["reducer"]],
            "median_manual_over_reducer": round(statistics.median(ratios), 3), "max_grad_diff": diff,
        }))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
