"""Exact resume and preemption: a run that stops and resumes ends where the straight run
ends, bit for bit, with the same logged metrics."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from gspo_lightning.cli import main
from tests.helpers_fit import metric_rows, policy_state, write_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def any_echo_reward(prompts, completions, target, **columns) -> list[float]:
    """1 when some judged word echoes the target, else 0: many groups of the untrained model score all 0."""
    from gspo_lightning.data.tasks.echo import echo_reward

    return [float(score > 0) for score in echo_reward(prompts, completions, target)]


DYNAMIC = {"dynamic_sampling": True, "max_sampling_rounds": 2, "overlong_filtering": True,
           "rewards": [{"function": "tests.test_resume.any_echo_reward"}]}


@pytest.mark.parametrize("model", [{}, DYNAMIC], ids=["plain", "dynamic_sampling"])
def test_stop_and_resume_matches_the_straight_run_bit_for_bit(tmp_path, model, monkeypatch):
    # the thread count chosen, not timed: the CPU-thread rule times its trial steps, and on a loaded
    # machine the two runs may choose differently (engine log-probs then differ by ~1e-8)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    straight = tmp_path / "straight"
    main(["fit", "--config", str(write_config(straight, 6, **model))])  # 6 rollout steps of 2 optimizer steps

    resumed = tmp_path / "resumed"
    main(["fit", "--config", str(write_config(resumed, 3, **model))])
    main(["fit", "--config", str(write_config(resumed, 6, **model)), "--ckpt_path", str(resumed / "ckpt" / "last.ckpt")])

    a, b = policy_state(straight / "ckpt" / "last.ckpt"), policy_state(resumed / "ckpt" / "last.ckpt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    full = torch.load(resumed / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    assert full["gspo"]["policy_version"] == 12 and full["gspo"]["rollout_steps"] == 6
    rows_a, rows_b = metric_rows(straight), metric_rows(resumed)
    assert sorted(rows_a) == sorted(rows_b) == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    for version in rows_a:
        assert rows_a[version] == rows_b[version], version
    if model:  # extra rounds ran and filled steps from the extra prompt stream, resumed at its position
        extra = [row for row in rows_a.values() if float(row["dynamic_sampling/rounds"]) > 1
                 and float(row["dynamic_sampling/groups_filled"]) < float(row["dynamic_sampling/groups_dropped"])]
        assert extra, list(rows_a.values())


def wait_for_rows(folder: Path, count: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if len(metric_rows(folder)) >= count:
            return
        time.sleep(0.2)
    raise TimeoutError("the run did not log in time")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_writes_a_checkpoint_exits_cleanly_and_resumes(tmp_path, sig):
    folder = tmp_path / "run"
    cfg = write_config(folder, 400, response_length=12)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(cfg)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(folder, 2, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "resume with --ckpt_path" in out + err
    ckpt = folder / "ckpt" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    stopped_at, step = state["gspo"]["policy_version"], state["global_step"]
    assert 4 <= stopped_at < 800 and stopped_at == 2 * step  # 2 optimizer steps per rollout step

    main(["fit", "--config", str(write_config(folder, step + 2, response_length=12)), "--ckpt_path", str(ckpt)])
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["gspo"]["policy_version"] == stopped_at + 4


def test_a_failing_reward_function_stops_the_run_with_a_checkpoint_of_the_work_so_far(tmp_path):
    from gspo_lightning.rewards import RewardSpec
    from gspo_lightning.rewards.base import RewardError
    from tests.helpers_fit import CALLS, fit, make_module

    CALLS["n"] = 0
    reward = [RewardSpec(function="tests.helpers_fit.reward_that_fails_on_the_third_call")]
    module = make_module(rewards=reward, num_mini_batches=2)
    with pytest.raises(RewardError, match="the grader is down"):
        fit(module, tmp_path, max_steps=5, enable_checkpointing=True)
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 2 and saved["gspo"]["policy_version"] == 4  # the two steps before the failure
    # fixed (the counter moved on): the run resumes from there and finishes
    again = make_module(rewards=reward, num_mini_batches=2)
    fit(again, tmp_path / "resumed", max_steps=3, ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert again.policy_version == 6


def test_a_resumed_run_continues_its_log_folders_and_curves(tmp_path):
    import json

    def config(max_steps):
        path = write_config(tmp_path, max_steps)
        cfg = yaml.safe_load(path.read_text())
        cfg["trainer"]["logger"] = [
            {"class_path": "gspo_lightning.run.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path), "name": "csv"}},
            {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(tmp_path), "name": "tb"}},
        ]
        path.write_text(yaml.safe_dump(cfg))
        return path

    main(["fit", "--config", str(config(3))])
    main(["fit", "--config", str(config(5)), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt")])
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == ["version_0"]
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["version_0"]
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as handle:
        steps = [int(float(row["step"])) for row in csv.DictReader(handle) if row.get("policy_version")]
    assert steps == [1, 2, 3, 4, 5]  # the first run's rows kept, the resumed run's appended; step = steps done
    history = json.loads((tmp_path / "csv" / "version_0" / "history.json").read_text())
    assert [step for step, _ in history["reward/mean"]] == [1, 2, 3, 4, 5]


FAIL_AT = {"call": None, "n": 0}


def reward_that_fails_when_told(prompts, completions, **columns):
    FAIL_AT["n"] += 1
    if FAIL_AT["n"] == FAIL_AT["call"]:
        raise RuntimeError("the grader is down")
    return [float(len(c) > 0) for c in completions]


def test_last_ckpt_is_always_the_newest_state_over_stop_resume_stop_resume(tmp_path):
    """A user's run: checkpoints every 4 steps into the default folder, stopped by a failing
    reward function, resumed from last.ckpt, stopped again, resumed again. last.ckpt is the
    newest state after every run (the end of fit included) and no last-v1.ckpt appears."""

    def run(max_steps, fail_at_call=None, resume=True):
        FAIL_AT.update(call=fail_at_call, n=0)
        path = write_config(tmp_path, max_steps)
        cfg = yaml.safe_load(path.read_text())
        del cfg["checkpoint"]["dirpath"]  # the default: next to the logs, csv/version_0/checkpoints
        cfg["checkpoint"]["every_n_train_steps"] = 4
        cfg["model"]["rewards"] = [{"function": "tests.test_resume.reward_that_fails_when_told"}]
        cfg["trainer"]["logger"][0]["class_path"] = "gspo_lightning.run.loggers.CSVLogger"  # continues its folder
        path.write_text(yaml.safe_dump(cfg))
        args = ["fit", "--config", str(path)] + (["--ckpt_path", str(last)] if resume else [])
        if fail_at_call is None:
            main(args)
        else:
            with pytest.raises(SystemExit):  # gspo: error: ... the grader is down
                main(args)
        files = sorted(p.name for p in last.parent.iterdir())
        return torch.load(last, map_location="cpu", weights_only=True)["global_step"], files

    last = tmp_path / "csv" / "version_0" / "checkpoints" / "last.ckpt"
    assert run(10, fail_at_call=3, resume=False) == (2, ["last.ckpt"])  # steps 1, 2; the 3rd fails
    assert run(6) == (6, ["last.ckpt"])  # saved at 4 and, at the end of fit, at 6
    assert run(10, fail_at_call=2) == (7, ["last.ckpt"])  # step 7; step 8 fails
    assert run(9) == (9, ["last.ckpt"])  # saved at 8 and at the end, 9
