"""Stops within a grace period (``stop_grace_s``): SIGTERM or Ctrl-C during a long generation
abandons the step and writes the last finished step's state at once; during an update the update
finishes first; a second signal stops at once; a stop that outlasts the grace exits with one line.
Each run is a real `gspo fit` process, signalled as docker, SLURM or a terminal would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gspo_lightning.rollout.engine import RolloutEngine
from tests.helpers_fit import write_config

ROOT = Path(__file__).resolve().parents[1]


def _slow_from(env_key: str) -> tuple[int, float, Path]:
    """(the call from which to be slow, for how many seconds, the file to touch then) from the
    test's environment: ``call:seconds:path``."""
    call, seconds, marker = os.environ[env_key].split(":", 2)
    return int(call), float(seconds), Path(marker)


def _sleep(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # short sleeps: the signal handler runs between them
        time.sleep(0.05)


class SlowEngine(RolloutEngine):
    """The Hugging Face engine, whose generation is slow from its N-th call on."""

    def __init__(self):
        super().__init__()
        from gspo_lightning.rollout.hf import HFEngine

        self.inner, self.calls = HFEngine(), 0
        self.shares_policy_weights = True

    def start(self, spec):
        self.inner.start(spec)

    def generate(self, prompt_ids, n, params, seed):
        self.calls += 1
        slow_from, seconds, marker = _slow_from("SLOW_ENGINE")
        if self.calls >= slow_from:
            marker.touch()
            _sleep(seconds)
        return self.inner.generate(prompt_ids, n, params, seed)


class SlowAdamW(torch.optim.AdamW):
    """AdamW whose N-th optimizer step is slow."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        slow_at, seconds, marker = _slow_from("SLOW_OPTIMIZER")
        if self.calls == slow_at:
            marker.touch()
            _sleep(seconds)
        return super().step(closure)


def _start(tmp_path: Path, env: dict, *extra: str, **model) -> subprocess.Popen:
    config = write_config(tmp_path / "run", 50, **model)
    return subprocess.Popen([sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(config), *extra],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(marker: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached the slow part"
        time.sleep(0.05)
    time.sleep(0.3)  # well inside it


def _global_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_during_a_long_generation_abandons_the_step_and_saves_the_last_one_at_once(tmp_path, sig):
    marker = tmp_path / "generating"
    proc = _start(tmp_path, {"SLOW_ENGINE": f"3:120:{marker}"}, "--stop_grace_s=10",
                  engine={"class_path": "tests.test_stops.SlowEngine"})
    _wait_for(marker, proc)
    asked = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - asked
    assert took < 10, (took, err[-2000:])
    assert proc.returncode == 0, err[-3000:]
    name = "SIGTERM" if sig == signal.SIGTERM else "Ctrl-C"
    assert f"{name}: abandoning step 3's rollout and writing the state of step 2" in err
    checkpoint = tmp_path / "run" / "ckpt" / "last.ckpt"
    line = f"{name}: step 3 abandoned; checkpoint written to {checkpoint} at step 2; resume with --ckpt_path {checkpoint}"
    assert line in out, out[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert _global_step(checkpoint) == 2


@pytest.mark.parametrize("slow_at", [3, 4], ids=["first-optimizer-step", "last-optimizer-step"])
def test_an_update_under_way_finishes_then_the_checkpoint_is_written(tmp_path, slow_at):
    # optimizer steps 3 and 4 are step 2's update; Lightning's step count moves at the first
    marker = tmp_path / "updating"
    proc = _start(tmp_path, {"SLOW_OPTIMIZER": f"{slow_at}:3:{marker}"}, "--stop_grace_s=10",
                  optimizer={"class_path": "tests.test_stops.SlowAdamW", "init_args": {"lr": 0.003}})
    _wait_for(marker, proc)  # optimizer step 3: the update of rollout step 2 (2 optimizer steps a step)
    asked = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - asked < 10 and proc.returncode == 0, err[-3000:]
    assert "SIGTERM: finishing step 2's update, then writing the checkpoint (within stop_grace_s=10 s" in err
    checkpoint = tmp_path / "run" / "ckpt" / "last.ckpt"
    assert f"SIGTERM: checkpoint written to {checkpoint} at step 2; resume with --ckpt_path {checkpoint}" in out
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert state["global_step"] == 2 and state["gspo"]["policy_version"] == 4  # the whole update of step 2


def test_a_second_signal_stops_at_once(tmp_path):
    marker = tmp_path / "updating"
    proc = _start(tmp_path, {"SLOW_OPTIMIZER": f"3:30:{marker}"}, "--stop_grace_s=60",
                  optimizer={"class_path": "tests.test_stops.SlowAdamW", "init_args": {"lr": 0.003}})
    _wait_for(marker, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None, "the first signal must let the update finish"
    asked = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - asked
    assert "SIGTERM: finishing step 2's update, then writing the checkpoint" in err
    assert "SIGTERM again: stopping now, without a checkpoint" in err
    assert took < 12, took  # not the 29 s the update still had to sleep (a loaded CI machine took 5.1 s)
    assert proc.returncode != 0
    assert _global_step(tmp_path / "run" / "ckpt" / "last.ckpt") == 1  # step 1's periodic checkpoint, untouched


def test_an_update_that_outlasts_the_grace_exits_with_one_line(tmp_path):
    marker = tmp_path / "updating"
    proc = _start(tmp_path, {"SLOW_OPTIMIZER": f"3:30:{marker}"}, "--stop_grace_s=2",
                  optimizer={"class_path": "tests.test_stops.SlowAdamW", "init_args": {"lr": 0.003}})
    _wait_for(marker, proc)
    asked = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - asked
    assert 2 <= took < 6, took
    assert proc.returncode == 1
    checkpoints = tmp_path / "run" / "ckpt"
    assert (f"gspo: the stop did not finish within stop_grace_s=2 s (nothing was written in this stop; the newest "
            f"checkpoint is the last periodic one in {checkpoints}): exiting now") in err, err[-2000:]
    assert _global_step(checkpoints / "last.ckpt") == 1


def test_a_stop_during_agent_episodes_ends_the_agents_and_the_endpoint_at_once(tmp_path):
    """The lookup agents in 2 worker processes, their calls waiting on a slow generation: SIGTERM
    answers the waiting calls, ends the workers and the endpoint, and writes the last step, within
    the grace and without a traceback (the endpoint's shutdown once waited for its open requests)."""
    from tests.helpers_agents import agent_config

    marker = tmp_path / "generating"
    config = agent_config(tmp_path / "run", steps=50, **{"episodes.agent_processes": 2,
                                                         "engine": {"class_path": "tests.test_stops.SlowEngine"}})
    proc = subprocess.Popen([sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", config,
                             "--checkpoint.every_n_train_steps=1"], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "SLOW_ENGINE": f"7:120:{marker}"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(marker, proc)
    asked = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - asked
    assert took < 10 and proc.returncode == 0, (took, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("SIGTERM: step "))
    step = int(line.split()[2])
    assert "checkpoint written to" in line and f"at step {step - 1};" in line
    checkpoint = next((tmp_path / "run").rglob("last.ckpt"))
    assert _global_step(checkpoint) == step - 1 >= 1


def test_a_sigterm_during_an_evaluation_writes_the_step_before_it(tmp_path):
    """An evaluation runs between steps: SIGTERM during its generation abandons it and writes the
    state of the step just finished (the abandoned evaluation is not redone; the next due one runs)."""
    marker = tmp_path / "evaluating"
    # generate calls: 1-2 are steps 1-2, 3 is the evaluation after step 2 (one batch of held-out prompts)
    proc = _start(tmp_path, {"SLOW_ENGINE": f"3:120:{marker}"}, "--stop_grace_s=10", "--trainer.limit_val_batches=2",
                  "--trainer.val_check_interval=2", "--trainer.num_sanity_val_steps=0", "--data.val_size=8",
                  engine={"class_path": "tests.test_stops.SlowEngine"})
    _wait_for(marker, proc)
    asked = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - asked < 10 and proc.returncode == 0, err[-3000:]
    checkpoint = tmp_path / "run" / "ckpt" / "last.ckpt"
    assert "SIGTERM: abandoning the evaluation and writing the state of step 2" in err
    line = f"SIGTERM: the evaluation abandoned; checkpoint written to {checkpoint} at step 2; resume with --ckpt_path {checkpoint}"
    assert line in out, out[-2000:]
    assert _global_step(checkpoint) == 2 and "Traceback" not in err
