"""The async benchmark's bookkeeping (no timing here): each k >= 1 arm is read against its own
synchronous arm, seed by seed, and the vLLM arms need an environment with vLLM."""

import pytest

from tests.helpers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_async.py")


def run(arm, seed, step_s):
    return {"arm": arm, "seed": seed, "step_s": step_s, "generate_s": 0.01, "wall_s": 10.0,
            "last_tenth_reward": 0.99, "heldout_accuracy": 1.0}


def test_ratios_pair_runs_of_the_same_seed(bench):
    # seed 0 ran on a quiet machine, seed 1 on a slower one: the ratio per seed is 0.5 and 0.6,
    # while the ratio of the medians (0.15 / 0.25) would mix the two machines' speeds
    runs = [run("server-sync", 0, 0.1), run("server-k1", 0, 0.05), run("server-sync", 1, 0.4), run("server-k1", 1, 0.24)]
    rows = bench.report(runs, ["server-sync", "server-k1"]).splitlines()
    assert rows[3].startswith("| server-k1 | 0.1450 (0.0500, 0.2400) |")
    assert "0.55x vs server-sync" in rows[3]  # median of 0.5 and 0.6
    assert "| - |" in rows[2]  # its own synchronous arm (sync-1t) did not run


def test_vllm_arms_without_a_vllm_python_are_refused_before_any_run(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--arms", "vllm-server-sync", "vllm-server-k1"])
    assert "give --vllm-python PATH" in capsys.readouterr().err
