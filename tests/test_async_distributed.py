"""Asynchronous GSPO on 2 CPU ranks (gloo): a run with ``max_staleness`` k = 1 and k = 2
stopped after step 2 and resumed equals the straight 4-step run bit for bit (weights and
every logged metric, on each rank). Each rank samples its own prompts with its own seed, so
this needs every rank's rollouts generated ahead in the checkpoint, not rank 0's. The same
for the synchronous loop with dynamic sampling (k = 0, stopped after step 3), whose ranks
have drawn different numbers of extra prompt batches by then.

The same k = 1 run from a rollout server that rank 0 starts (``RemoteEngine``: the weight
push, with its collective over the ranks, runs on the producer thread beside the update's
collectives) equals the in-process float32 copy's run bit for bit."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "distributed" / "async_worker.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def same(a: dict, b: dict) -> bool:
    """Equal metrics, leaving out NaN (a value not measured at that step, as tests/test_resume.py does)."""
    a, b = ({k: v for k, v in m.items() if v == v} for m in (a, b))
    return a == b


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           "--ks", "0", "1", "2", "--steps", "4", "--stop_at", "2", "--stop_at_dynamic", "3", "--remote", "--out_dir", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = {k: [torch.load(out / f"k{k}" / f"rank{r}.pt", weights_only=False) for r in range(2)] for k in (0, 1, 2)}
    runs["remote"] = [torch.load(out / f"remote_rank{r}.pt", weights_only=False) for r in range(2)]
    return runs


@pytest.mark.parametrize("k", [0, 1, 2])
def test_async_two_ranks_stop_and_resume_equals_the_straight_run_bit_for_bit(runs, k):
    ranks = runs[k]
    saved = ranks[0]["checkpoint_gspo"]["ranks"]
    assert len(saved) == 2
    stop = 3 if k == 0 else 2
    if k == 0:  # each rank's own extra prompt position is in the checkpoint
        extra = [state["data"]["extra_batches_consumed"] for state in saved]
        assert extra[0] != extra[1], "the ranks drew as many extra batches: the test could not tell them apart"
    else:  # every rank's queue is in the checkpoint: batches 2 .. k + 1, each rank's own prompts
        for state in saved:
            assert [p["index"] for p in state["pending_rollouts"]["pending"]] == list(range(2, k + 2))
        prompts = [[p["prompt_ids"] for p in state["pending_rollouts"]["pending"]] for state in saved]
        assert prompts[0] != prompts[1], "the ranks hold the same prompts: the test could not tell their queues apart"
    for rank, result in enumerate(ranks):
        assert result["world"] == 2
        straight, resumed = result["straight"], result["resumed"]
        moved = max((straight["state"][n] - result["stopped"]["state"][n]).abs().max().item() for n in straight["state"])
        assert moved > 0, "steps 3 and 4 did not change the weights: the comparison would prove nothing"
        for name in straight["state"]:
            assert torch.equal(straight["state"][name], resumed["state"][name]), f"rank {rank}: {name}"
        # the straight run's steps after the stop against the resumed run's, the others against the stopped run's
        assert sorted(straight["metrics"]) == [1, 2, 3, 4] and sorted(resumed["metrics"]) == list(range(stop + 1, 5))
        for step in range(1, 5):
            run = result["stopped"] if step <= stop else resumed
            assert same(run["metrics"][step], straight["metrics"][step]), f"rank {rank}, step {step}"
        if k > 0:
            assert [straight["metrics"][s]["async/lag"] for s in (1, 2, 3, 4)] == [min(s - 1, k) for s in (1, 2, 3, 4)]


def test_async_two_ranks_from_a_rollout_server_equal_the_in_process_copy(runs):
    for rank in range(2):
        local, remote = runs[1][rank]["straight"], runs["remote"][rank]["straight"]
        for name in local["state"]:
            assert torch.equal(local["state"][name], remote["state"][name]), f"rank {rank}: {name}"
        assert [remote["metrics"][s]["async/lag"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
        for step in (1, 2, 3, 4):
            assert remote["metrics"][step]["reward/mean"] == local["metrics"][step]["reward/mean"]
