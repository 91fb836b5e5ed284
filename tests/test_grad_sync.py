"""``GradientSync`` on a one-rank gloo group: DDP's sync is off exactly inside the
micro-batches that are not their optimizer step's last (``no_sync``)."""

import pytest
import torch
import torch.distributed as dist

from gspo_lightning.training.distributed import GradientSync, PolicyForward


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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
