"""One optimizer step on 2 CPU ranks (gloo) equals 1 rank on the same global batch:
same updated weights, same logged metrics, for DDP and FSDP2 (ModelParallelStrategy)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from worker import CASES  # noqa: E402

WORKER = Path(__file__).parent / "distributed" / "worker.py"
ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def launch(out_dir: Path, ranks: int, strategy: str, cases: tuple[str, ...] = tuple(CASES), timeout: float = 600) -> dict:
    """Every case in one launch (process start-up dominates), one result file per case."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(WORKER), "--strategy", strategy, "--out_dir", str(out_dir), "--cases", *cases]
    # the package and tests of this checkout, not an installed copy's (the worker runs as a script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # a session of its own: a hung launch is ended with its ranks, not only torchrun
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise AssertionError(f"{ranks} ranks ({strategy}, {list(cases)}) did not finish in {timeout:.0f} s: a rank waits in a collective")
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return {case: torch.load(out_dir / f"{case}.pt") for case in cases}


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
        if case == "episodes":  # the episodes' counts and token fraction are the whole batch's on every layout
            assert one["metrics"]["episode/turns"] > 1 and one["metrics"]["episode/environment_token_frac"] > 0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_ranks_whose_episodes_take_different_numbers_of_turns(tmp_path, strategy):
    """Rank 0's episodes go on for 3 turns, rank 1's end after one. DDP: each rank samples its own
    turns (3 and 1 generate calls). FSDP2 with an engine that gathers the sharded weights in every
    generate (HFEngine's way), a collective: rank 1 takes stand-in turns so both make 3 calls, where
    it would otherwise leave rank 0 waiting in the gather for ever (hence the short timeout)."""
    calls = launch(tmp_path, 2, strategy, ("episodes-uneven",), timeout=240)["episodes-uneven"]["calls"]
    assert calls == {"ddp": [3, 1], "fsdp2": [3, 3]}[strategy]


def test_a_reward_failure_on_one_rank_stops_every_rank_with_one_checkpoint(tmp_path):
    """max_staleness: 0: rank 1's reward function raises at step 2. Both ranks stop on that step
    (rank 0 with the same error class, naming rank 1) instead of rank 0 waiting in the update's
    collectives for ever, and last.ckpt holds step 1."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           "--out_dir", str(tmp_path), "--cases", "reward-fails-on-rank-1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, start_new_session=True)
    stopped = {rank: (tmp_path / f"stopped-{rank}.txt").read_text() for rank in (0, 1)
               if (tmp_path / f"stopped-{rank}.txt").exists()}
    assert set(stopped) == {0, 1}, result.stdout[-3000:] + result.stderr[-3000:]
    assert stopped[1].startswith("RewardError: reward function 'reward_that_fails_on_rank_one_at_step_two': raised "
                                 "ConnectionError: the grader is down")
    assert stopped[0].startswith("RewardError: the rollout of prompt batch 1 failed on rank 1: ")
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 1
    assert "a reward function failed at step 2; the run up to step 1 is saved in" in result.stdout


def test_fsdp1_is_refused_with_the_fsdp2_command():
    """FSDP1 runs training_step inside its root forward, where a GSPO step's backward fails
    (seen on an H100). The refusal names the strategy that works, as a command that parses."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from gspo_lightning.training.distributed import check_strategy

    with pytest.raises(ValueError, match=r"FSDPStrategy \(FSDP1\) cannot train GSPO") as info:
        check_strategy(FSDPStrategy())
    assert "--trainer.strategy.class_path=lightning.pytorch.strategies.ModelParallelStrategy" in str(info.value)
    for strategy in (DDPStrategy(), ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)):
        check_strategy(strategy)  # the strategies that train GSPO pass


def test_the_refusal_happens_before_the_model_loads(monkeypatch):
    """GSPOModule.setup checks the strategy first: nothing is loaded for a run that cannot start."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from gspo_lightning.training.module import GSPOModule

    module = GSPOModule(model_name_or_path="builtin:tiny-echo",
                        rewards=[{"function": "gspo_lightning.data.tasks.echo.echo_reward"}])
    loaded = []
    monkeypatch.setattr(module, "configure_model", lambda: loaded.append(True))
    monkeypatch.setattr(GSPOModule, "trainer", property(lambda self: SimpleNamespace(strategy=FSDPStrategy())))
    with pytest.raises(ValueError, match="FSDP1"):
        module.setup("fit")
    assert not loaded
