"""``GradientSync`` on a one-rank gloo group: the manual bucketed sum puts every gradient
back in its own place and shape, and DDP's sync is off exactly inside the micro-batches
that are not their optimizer step's last (``no_sync``)."""

import pytest
import torch
import torch.distributed as dist

from gspo_lightning.training import distributed
from gspo_lightning.training.distributed import GradientSync, PolicyForward


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_manual_reduce_restores_every_gradient_in_small_buckets(one_rank_group, monkeypatch):
    monkeypatch.setattr(distributed, "BUCKET_BYTES", 40)  # 10 float32 per bucket: the 3 grads span 2 buckets
    shapes = [(2, 3), (4,), (3, 1)]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    expected = []
    for i, p in enumerate(params):
        p.grad = torch.arange(p.numel(), dtype=torch.float32).view(p.shape) + 100 * i
        expected.append(p.grad.clone())
    unused = torch.nn.Parameter(torch.ones(2))  # no gradient on this rank: joins the sum as zeros
    assert GradientSync("manual").reduce([*params, unused], True, torch.device("cpu")) is True
    for p, want in zip(params, expected):
        assert p.grad.shape == want.shape and torch.equal(p.grad, want)  # the sum over one rank
    assert torch.equal(unused.grad, torch.zeros(2))
    assert GradientSync("manual").reduce(params, False, torch.device("cpu")) is False  # a skipped step: no sum


def test_ddp_syncs_only_in_the_last_micro_batch(one_rank_group):
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(PolicyForward(torch.nn.Linear(2, 1), lambda policy, x: policy(x)))
    sync = GradientSync("reducer", 1.0, ddp)
    seen = []
    for last in (False, False, True):
        with sync.accumulate(last):
            seen.append(ddp.require_backward_grad_sync)
            ddp(torch.ones(1, 2)).sum().backward()
    assert seen == [False, False, True] and ddp.require_backward_grad_sync
    with GradientSync("none").accumulate(False):  # one process: nothing to hold back
        pass
