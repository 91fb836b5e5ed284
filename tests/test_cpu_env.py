"""`gspo serve` sets OpenMP's wait policy before torch loads (a user's own value wins); training
runs leave it and choose their thread count by the model and the load (run/cpu_threads.py)."""

import os
import subprocess
import sys
from pathlib import Path

from gspo_lightning.run.cpu_env import configure_cpu_env

ROOT = Path(__file__).resolve().parents[1]

# Records OMP_WAIT_POLICY at the moment `import torch` starts, with the `gspo` command's dispatch
# run first (its --help exits before any work; torch is imported after it if it was not during it).
PROBE = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY", "<unset>"))
        return None
sys.meta_path.insert(0, Watch())
from gspo_lightning.cli import main
try:
    main([sys.argv[1], "--help"])
except SystemExit:
    pass
import torch
print("AT_TORCH_IMPORT=" + seen[0])
"""


def _policy_at_torch_import(command: str, extra_env: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(extra_env, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", PROBE, command], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().rsplit("AT_TORCH_IMPORT=", 1)[1]


def test_serve_sets_the_wait_policy_before_torch_loads_fit_leaves_it_and_the_users_value_wins():
    assert _policy_at_torch_import("serve", {}) == "PASSIVE"
    assert _policy_at_torch_import("serve", {"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
    assert _policy_at_torch_import("fit", {}) == "<unset>"


def test_configure_cpu_env_fills_only_unset_values():
    env = {"OMP_NUM_THREADS": "3"}
    assert configure_cpu_env("serve", env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
    mine = {"OMP_WAIT_POLICY": "active"}
    assert configure_cpu_env("serve", mine) == {} and mine == {"OMP_WAIT_POLICY": "active"}
    assert configure_cpu_env("fit", {}) == {}


# -- threads chosen by the model's size (run/cpu_threads.py) ---------------------------------

import lightning as L  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from gspo_lightning.run.cpu_threads import (  # noqa: E402
    KEEP_MORE_IF, TRIAL_BELOW_STEP_S, TRIAL_S, CPUSample, CPUThreads, next_thread_count, sample_cpu, threads_for, trial_verdict,
    usable_cores, user_sets_threads,
)


@pytest.mark.parametrize("cores, ranks, expected", [
    (16, 1, 16),
    (16, 4, 4),      # 4 ranks on the machine share its cores
    (3, 2, 1),       # never 0
    (1, 1, 1),
])
def test_a_rank_starts_on_its_share_of_the_cores(cores, ranks, expected):
    assert threads_for(cores, ranks) == expected


@pytest.mark.parametrize("most, one, keep", [
    ([0.071, 0.074, 0.070], [0.084, 0.082, 0.083], True),   # the grid's 0.07M cell, 16 tokens: 0.85x
    ([0.080, 0.081, 0.079], [0.082, 0.083, 0.081], False),  # the quickstart: a tie keeps one thread
    ([0.089, 0.070, 0.500], [0.100, 0.101, 0.099], True),   # medians, not means: one slow step does not decide
    ([0.9, 0.9, 0.9], [1.0, 1.0, 1.0], False),    # exactly at the margin: not clearly faster
])
def test_all_cores_stay_only_when_clearly_faster_than_one(most, one, keep):
    assert KEEP_MORE_IF == 0.9
    assert trial_verdict(most, one) is keep


def test_a_cgroup_cpu_quota_caps_the_cores(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # --cpus=1.5: one whole core
    assert usable_cores(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{100000 * (affinity + 8)} 100000\n")  # more than the affinity allows
    assert usable_cores(tmp_path) == affinity
    assert usable_cores(tmp_path / "absent") == affinity


def test_the_users_omp_num_threads_wins():
    assert user_sets_threads({"OMP_NUM_THREADS": "3"}) and not user_sets_threads({"OMP_NUM_THREADS": " "})
    assert not user_sets_threads({})


class RecordThreads(L.Callback):
    def __init__(self):
        self.during = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.during.append(torch.get_num_threads())


def _fit_recording_threads(tmp_path, model: str, environ: dict, before: int) -> tuple[list, int]:
    from gspo_lightning.data.datamodule import PromptDataModule
    from gspo_lightning.rewards import RewardSpec
    from gspo_lightning.training.module import GSPOModule

    module = GSPOModule(model_name_or_path=model, rewards=[RewardSpec(function="gspo_lightning.data.tasks.echo.echo_reward")],
                        num_return_sequences_in_group=2, response_length=2, mini_batch_size=4)
    module.configure_callbacks = lambda: [CPUThreads(environ=environ)]  # the rule alone, with the given environment
    data = PromptDataModule(path="builtin:echo", tokenizer=model, rollout_batch_size=2, prompt_length=8, val_size=0)
    record = RecordThreads()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=tmp_path, callbacks=[record])
    torch.set_num_threads(before)
    try:
        trainer.fit(module, datamodule=data)
        return record.during, torch.get_num_threads()
    finally:
        torch.set_num_threads(1)  # conftest's setting for the rest of the session


def test_a_run_starts_on_its_cores_and_the_count_is_put_back_after_fit(tmp_path):
    during, after = _fit_recording_threads(tmp_path, "builtin:tiny-echo", environ={}, before=3)
    assert during == [threads_for(usable_cores())] and after == 3


def test_with_omp_num_threads_set_the_rule_leaves_torchs_count_alone(tmp_path):
    during, after = _fit_recording_threads(tmp_path, "builtin:tiny-echo", environ={"OMP_NUM_THREADS": "2"}, before=2)
    assert during == [2] and after == 2


@pytest.mark.parametrize("current, most, cores, waiting, others, expected", [
    (2, 2, 2, 0.01, 0.0, 2),     # quiet: all cores
    (2, 2, 2, 0.45, 0.9, 1),     # one busy neighbour on 2 cores: our threads waited 45% of the time
    (16, 16, 16, 0.20, 4.0, 13),  # 16 cores, a neighbour on 4: keep the 80% that ran (12.8 -> 13)
    (2, 2, 2, 0.16, 0.5, 1),     # just above the line: at least one fewer
    (1, 2, 2, 0.02, 1.0, 1),     # the neighbour still holds its core: no idle core to take
    (1, 2, 2, 0.02, 0.6, 1),     # 0.4 of a core idle: under the half-core slack
    (1, 2, 2, 0.02, 0.02, 2),    # the neighbour left: back to all cores
    (4, 16, 16, 0.02, 5.0, 11),  # 7 idle cores taken at once (16 - 5 - 4)
    (1, 1, 2, 0.9, 0.0, 1),      # never below one
])
def test_the_thread_count_follows_the_waiting_and_the_idle_cores(current, most, cores, waiting, others, expected):
    assert next_thread_count(current, most, cores, waiting, others) == expected


def test_cpu_counters_are_read_from_proc(tmp_path):
    (tmp_path / "self" / "task" / "101").mkdir(parents=True)
    (tmp_path / "self" / "task" / "102").mkdir(parents=True)
    (tmp_path / "self" / "task" / "101" / "schedstat").write_text("900 250000000 12\n")
    (tmp_path / "self" / "task" / "102" / "schedstat").write_text("900 50000000 3\n")
    # user nice system idle iowait irq softirq steal: busy = 100+0+20+0+0+5 = 125 ticks
    (tmp_path / "stat").write_text("cpu  100 0 20 900 40 0 5 0 0 0\ncpu0 50 0 10 450 20 0 2 0 0 0\n")
    first = sample_cpu(tmp_path)
    assert first.waiting_ns == {101: 250_000_000, 102: 50_000_000}
    assert first.busy_cpu_s == pytest.approx(125 / os.sysconf("SC_CLK_TCK"))
    (tmp_path / "self" / "task" / "102" / "schedstat").write_text("900 80000000 4\n")
    (tmp_path / "self" / "task" / "103").mkdir()  # born meanwhile, with delay from before: not counted
    (tmp_path / "self" / "task" / "103" / "schedstat").write_text("900 9000000000 4\n")
    assert sample_cpu(tmp_path).waiting_since(first) == pytest.approx(0.03)
    assert sample_cpu(tmp_path / "absent") is None


class FakeModule:
    def __init__(self, parameters: int):
        self.policy = torch.nn.Linear(parameters, 1, bias=False)
        self.logged = []

    def log(self, name, value, **kwargs):
        self.logged.append((name, value))

    def log_dict(self, values, **kwargs):
        self.logged += list(values.items())


def _quiet_steps(durations: list[float]) -> list[CPUSample]:
    """Counters at the start and end of each step: nothing waited, nothing else ran."""
    script, t = [], 100.0
    for seconds in durations:
        script += [CPUSample(t, {1: 0}, 0.0, 0.0), CPUSample(t + seconds, {1: 0}, 0.0, 0.0)]
        t += seconds + 0.01
    return script


def _run_steps(callback, module, trainer, steps: int) -> list[int]:
    """The count each step ran with, and after the last."""
    threads = []
    for step in range(steps):
        threads.append(torch.get_num_threads())
        callback.on_train_batch_start(trainer, module, None, step)
        callback.on_train_batch_end(trainer, module, None, None, step)
    return threads + [torch.get_num_threads()]


@pytest.fixture
def two_cores(monkeypatch):
    from gspo_lightning.run import cpu_threads

    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    yield type("T", (), {"num_devices": 1})()
    torch.set_num_threads(1)  # conftest's count


def test_short_steps_try_one_thread_and_keep_it_when_two_are_no_faster(two_cores):
    # warm-up, 3 steps on 2 threads, 3 on one: 0.40 vs 0.42 s, not clearly faster
    script = _quiet_steps([0.9, 0.40, 0.40, 0.40, 0.42, 0.42, 0.42])
    callback, module = CPUThreads(environ={}, sample=lambda: script.pop(0)), FakeModule(10)
    callback.on_fit_start(two_cores, module)
    assert _run_steps(callback, module, two_cores, 9) == [2, 2, 2, 2, 1, 1, 1, 1, 1, 1]
    assert not script, "after choosing one thread the counters are no longer read"
    logged = dict(module.logged)
    assert logged["cpu/trial_step_s_all"] == pytest.approx(0.40) and logged["cpu/trial_step_s_one"] == pytest.approx(0.42)


def test_short_steps_keep_all_cores_when_clearly_faster_and_then_follow_the_load(two_cores):
    # warm-up, 4 steps of 0.08 s on 2 threads (4 to time at least TRIAL_S), 3 of 0.11 s on one: 2 win
    # (0.08 < 0.9 x 0.11); then the windows of the load rule: one quiet step of 1 s keeps 2
    assert TRIAL_S == 0.3
    script = _quiet_steps([0.5, 0.08, 0.08, 0.08, 0.08, 0.11, 0.11, 0.11, 1.0])
    callback, module = CPUThreads(environ={}, sample=lambda: script.pop(0)), FakeModule(10)
    callback.on_fit_start(two_cores, module)
    assert _run_steps(callback, module, two_cores, 9) == [2, 2, 2, 2, 2, 1, 1, 1, 2, 2]
    assert [v for k, v in module.logged if k == "cpu/wait_frac"] == [0.0]  # the load rule's first window


def test_long_steps_keep_all_cores_without_a_trial(two_cores):
    script = _quiet_steps([3.0, TRIAL_BELOW_STEP_S, 2.0])
    callback, module = CPUThreads(environ={}, sample=lambda: script.pop(0)), FakeModule(10)
    callback.on_fit_start(two_cores, module)
    assert _run_steps(callback, module, two_cores, 3) == [2, 2, 2, 2]
    assert not any(k.startswith("cpu/trial") for k, _ in module.logged)
    assert [v for k, v in module.logged if k == "cpu/wait_frac"] == [0.0]  # the third step: the load rule's


def test_beside_a_busy_process_the_count_drops_and_comes_back_when_it_leaves(two_cores):
    """The callback's decisions from scripted counters: a window where our two threads waited half
    the time drops to one; a window where nothing else ran brings the second back."""
    clock = {"t": 0.0}

    def counters(waited_s: float, others_s: float, own_s: float):
        clock["t"] += 1.0
        return CPUSample(clock["t"], {1: int(waited_s * 1e9)}, own_s, own_s + others_s)

    script = [counters(0, 0, 0), counters(0, 0, 0), counters(0, 0, 0), counters(0, 0, 0),  # warm-up, a long step: no trial
              counters(0, 0, 0), counters(1.0, 1.0, 1.0),      # contended: 1 s waited over 1 s x 2 threads
              counters(1.0, 1.0, 1.0), counters(1.0, 2.0, 2.0),  # the neighbour still there
              counters(1.0, 2.0, 2.0), counters(1.0, 2.0, 3.0)]  # gone: nothing else ran
    callback, module = CPUThreads(environ={}, sample=lambda: script.pop(0)), FakeModule(10)
    callback.on_fit_start(two_cores, module)
    assert torch.get_num_threads() == 2
    assert _run_steps(callback, module, two_cores, 5)[2:] == [2, 1, 1, 2]
    assert [v for k, v in module.logged if k == "cpu/wait_frac"] == [0.5, 0.0, 0.0]
    callback.teardown(two_cores, module, "fit")
    assert torch.get_num_threads() == 1  # conftest's count, put back
