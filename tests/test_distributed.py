"""One optimizer step on 2 CPU ranks (gloo) equals 1 rank on the same global batch:
same updated weights, same logged metrics, for DDP and FSDP2 (ModelParallelStrategy)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from worker import CASES  # noqa: E402

WORKER = Path(__file__).parent / "distributed" / "worker.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def launch(out_dir: Path, ranks: int, strategy: str) -> dict:
    """Every case in one launch (process start-up dominates), one result file per case."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(WORKER), "--strategy", strategy, "--out_dir", str(out_dir)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {case: torch.load(out_dir / f"{case}.pt") for case in CASES}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("single"), 1, "ddp")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_equal_one_rank(tmp_path, single, strategy):
    results = launch(tmp_path, 2, strategy)
    for case in CASES:
        one, two = single[case], results[case]
        assert two["world"] == 2
        # DDP: the policy's own DDP wrapper syncs in the last micro-batch's backward
        assert two["grad_sync"] == {"ddp": "reducer", "fsdp2": "strategy"}[strategy]
        moved = max((one["state"][k] - one["initial"][k]).abs().max().item() for k in one["state"])
        assert moved > 1e-3, "the step did not change the weights: the comparison would prove nothing"
        assert one["state"].keys() == two["state"].keys()
        for name in one["state"]:
            torch.testing.assert_close(two["state"][name], one["state"][name], atol=1e-6, rtol=1e-5, msg=f"{case}: {name}")
        skip = {"step_s"}  # wall time shown in the progress bar
        assert set(one["metrics"]) - skip == set(two["metrics"]) - skip, case
        for key in set(one["metrics"]) - skip:
            assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-6), f"{case}: {key}"
