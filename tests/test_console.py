"""The run as a user sees it: what the ``gspo`` command prints (no terminal, as under nohup or
SLURM), the files it writes, its errors and its help."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
NOISE = ["Tip:", "Writing model shards", "will override existing callbacks", "weights_only", "Traceback",
         "Trainer already configured", "GPU available: False", "TPU available", "Loading weights"]


def gspo(*args, cwd=ROOT, timeout=600, env=None, **popen):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    command = [sys.executable, "-m", "gspo_lightning.cli", *args]
    if popen:
        return subprocess.Popen(command, cwd=cwd, env=env, text=True, **popen)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def quickstart(run: Path, *extra):
    return ["fit", "--config", QUICKSTART, f"--trainer.default_root_dir={run}", "--trainer.max_steps=20",
            "--trainer.val_check_interval=10", *extra]


def metric_rows(run: Path) -> list[dict]:
    with open(run / "csv" / "version_0" / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def assert_one_numbering(run: Path, steps: int, every: int) -> None:
    """Every step's row once, numbered 1..steps; evaluations at 0, every, 2 every... in
    metrics.csv and eval_results.jsonl alike."""
    rows = metric_rows(run)
    trained = [int(float(r["step"])) for r in rows if r.get("reward/mean")]
    assert trained == list(range(1, steps + 1))
    evaluated = [int(float(r["step"])) for r in rows if r.get("val/accuracy")]
    assert evaluated == list(range(0, steps + 1, every))
    jsonl = [json.loads(line) for line in (run / "csv" / "version_0" / "eval_results.jsonl").read_text().splitlines()]
    assert [e["step"] for e in jsonl] == evaluated
    assert [e["policy_version"] for e in jsonl] == [4 * s for s in evaluated]  # 4 optimizer steps a step


@pytest.mark.slow
def test_a_run_without_a_terminal_prints_progress_lines_phases_and_held_out_results(tmp_path):
    run = tmp_path / "run"
    out = gspo(*quickstart(run, "--export=best", "--trainer.callbacks+=gspo_lightning.run.LineProgressBar",
                           "--trainer.callbacks.every_n_steps=5", "--trainer.callbacks.interval_s=0.5"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    # a line every 5 steps (and the first), with the reward and the time left
    steps = [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+)/20  reward [\d.]+  step_s", line))]
    assert {1, 5, 10, 15, 20} <= set(steps), out.stdout
    # no time left promised from the first step (it warms up and times the CPU threads)
    assert next(line for line in lines if line.startswith("step 1/20 ")).endswith("left: estimating")
    assert re.search(r"left ~0:0\d:\d\d$", next(line for line in lines if line.startswith("step 5/20 ")))
    # held-out results when measured, and untrained -> best -> last at the end
    assert "held-out at step 0 (untrained): accuracy 0  pass@1 0  reward_mean 0" in out.stdout
    assert any(line.startswith("held-out at step 10: accuracy ") for line in lines)
    summary = next(line for line in lines if line.startswith("held-out accuracy: "))
    assert re.fullmatch(r"held-out accuracy: untrained 0 \(step 0\) -> best [\d.]+ \(step (10|20)\) -> "
                        r"last [\d.]+ \(step 20\)", summary), summary
    assert "policy exported to" in out.stdout and (run / "csv/version_0/checkpoints/best.ckpt").is_file()
    for noise in NOISE:
        assert noise not in out.stdout + out.stderr, noise
    assert_one_numbering(run, 20, 10)


def slow_successor_reward(prompts, completions, **columns):
    """The quickstart's reward, 1.5 s slower on training steps: steps slower than interval_s."""
    from gspo_lightning.data.tasks.successor import successor_reward

    if len(completions) == 128:
        time.sleep(float(os.environ.get("SLOW_REWARD_S", "1.5")))
    return successor_reward(prompts, completions, **columns)


@pytest.mark.slow
def test_slow_steps_print_their_phase_as_it_starts(tmp_path):
    out = gspo("fit", "--config", QUICKSTART, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=4",
               "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--model.export_on_fit_end=false",
               '--model.rewards=[{"function": "tests.test_console.slow_successor_reward"}]',
               "--trainer.callbacks+=gspo_lightning.run.LineProgressBar", "--trainer.callbacks.interval_s=1")
    assert out.returncode == 0, out.stderr[-3000:]
    # after the first slow step, the display names the phase of each step: scoring is part of generating
    phases = re.findall(r"^step (\d)/4  generating 128 responses, token 6/6  0:00:0\d in this phase", out.stdout, re.M)
    assert {"2", "3", "4"} <= set(phases), out.stdout


TRAINING_CALLS = {"n": 0}


def successor_reward_then_ctrl_c(prompts, completions, **columns):
    """The quickstart's reward; presses Ctrl-C during the step given by ``CTRL_C_AT_STEP``
    (counting training calls: 128 responses, where an evaluation scores 32 at a time)."""
    from gspo_lightning.data.tasks.successor import successor_reward

    if len(completions) == 128:
        TRAINING_CALLS["n"] += 1
        if TRAINING_CALLS["n"] == int(os.environ["CTRL_C_AT_STEP"]):
            os.kill(os.getpid(), signal.SIGINT)
    return successor_reward(prompts, completions, **columns)


@pytest.mark.slow
def test_ctrl_c_at_an_evaluation_step_then_resume_keeps_every_row_and_evaluation(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("CTRL_C_AT_STEP", "10")
    out = gspo(*quickstart(run, "--model.export_on_fit_end=false",
                           '--model.rewards=[{"function": "tests.test_console.successor_reward_then_ctrl_c"}]'))
    assert out.returncode == 0, out.stderr[-3000:]
    # pressed while step 10 was scoring its rollout: the step is abandoned, step 9 is saved, and
    # the evaluation due at step 10 waits for the resumed run's step 10
    assert "Ctrl-C: step 10 abandoned; checkpoint written to" in out.stdout and "at step 9;" in out.stdout, out.stdout
    assert "held-out at step 10" not in out.stdout and "step 10/" not in out.stdout
    ckpt = run / "csv" / "version_0" / "checkpoints" / "last.ckpt"

    monkeypatch.setenv("CTRL_C_AT_STEP", "0")  # the resumed run keeps the reward function, and runs to its end
    out = gspo(*quickstart(run, "--model.export_on_fit_end=false", f"--ckpt_path={ckpt}"))
    assert out.returncode == 0, out.stderr[-3000:]
    first = next(line for line in out.stdout.splitlines() if line.startswith("step "))
    assert first.startswith("step 10/20  reward"), out.stdout  # the bar's total and count go on
    assert "held-out at step 10: accuracy" in out.stdout
    assert "held-out at step 20: accuracy" in out.stdout and "untrained 0 (step 0)" in out.stdout
    for noise in NOISE:
        assert noise not in out.stdout + out.stderr, noise
    assert_one_numbering(run, 20, 10)


def in_process(capsys, *args) -> tuple[int, str]:
    """``gspo *args`` run in this process (no interpreter start, no torch import): its exit code and stderr."""
    from gspo_lightning.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return exited.value.code, capsys.readouterr().err


def test_unknown_keys_and_bad_values_are_one_line_naming_the_fix(tmp_path, capsys):
    out = gspo("fit", "--config", QUICKSTART, "--model.update.ppo_epoks=2")  # the command itself, once
    assert out.returncode == 2
    assert out.stderr.strip() == ("gspo: error: unknown key model.update.ppo_epoks: did you mean model.update.ppo_epochs? "
                                  "(gspo fit --help lists the keys)")
    # the others in process: the same code path after the interpreter starts
    code, err = in_process(capsys, "fit", "--config", QUICKSTART, "--model.clip_hihg=4e-4")  # a flat key of earlier releases, misspelled
    assert code == 2
    assert err.strip() == ("gspo: error: unknown key model.clip_hihg: did you mean model.clip_high? "
                           "(gspo fit --help lists the keys)")
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(QUICKSTART).read_text().replace("    response_length: 6", "    response_lenght: 6"))
    code, err = in_process(capsys, "fit", "--config", str(bad))
    assert code == 2 and err.strip().splitlines() == [
        "gspo: error: unknown key model.rollout.response_lenght: did you mean model.rollout.response_length? (gspo fit --help lists the keys)"]
    code, err = in_process(capsys, "fit", "--config", QUICKSTART, "--trainer.max_steps=-5", f"--trainer.default_root_dir={tmp_path}")
    errors = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and "Traceback" not in err
    assert errors == ["gspo: error: `max_steps` must be a non-negative integer or -1 (infinite steps). You passed in -5."]


def test_closest_key():
    from gspo_lightning.run.usage import closest_key

    keys = ["model.clip_high", "model.clip_low", "trainer.max_steps", "data.rollout_batch_size"]
    assert closest_key("model.clip_hihg", keys) == "model.clip_high"
    assert closest_key("clip_low", keys) == "model.clip_low"  # the section left out
    assert closest_key("data.rollout_batchsize", keys) == "data.rollout_batch_size"
    assert closest_key("model.banana", keys) is None


def test_help_says_what_gspo_is_and_fit_help_is_short_fast_and_true(tmp_path):
    out = gspo("--help")
    assert "Group Sequence Policy Optimization" in out.stdout
    assert all(f"\n  {name} " in out.stdout for name in ("fit", "validate", "test", "serve"))
    start = time.perf_counter()
    out = gspo("fit", "--help")
    assert out.returncode == 0 and time.perf_counter() - start < 10  # the full one builds the parser: torch, Lightning
    text = out.stdout
    assert len(text.splitlines()) < 70 and "--help-all" in text
    for group in ("run", "trainer", "model", "algorithm", "data", "checkpoints"):
        assert re.search(rf"^{group}\b", text, re.M), group
    # every key it names is a key of gspo fit
    from gspo_lightning.data.datamodule import PromptDataModule
    from gspo_lightning.run.command import GSPOCLI
    from gspo_lightning.run.usage import known_keys
    from gspo_lightning.training.module import GSPOModule

    class ParseOnly(GSPOCLI):
        def instantiate_classes(self) -> None:
            pass

        def _run_subcommand(self, subcommand: str) -> None:
            pass

    cli = ParseOnly(GSPOModule, PromptDataModule, args=["fit"], auto_configure_optimizers=False)
    keys = set(known_keys(cli._subcommand_parsers["fit"])) | {"config", "print_config", "debug"}
    named = {m.group(1) for m in re.finditer(r"--([\w.]+)", text)} - {"help", "help-all", "section.key"}
    unknown = {k for k in named if k not in keys and not any(k.startswith(f"{key}.init_args.") for key in keys)}
    assert len(named) > 30 and not unknown, sorted(unknown)


def test_a_slow_step_prints_its_phase_every_interval_and_as_each_phase_starts(capsys):
    """The line display's clock (a thread, once a second), driven by hand: a step running for
    longer than interval_s gets a line with its phase; after a slow step, each new phase its line."""
    from gspo_lightning.rollout.phases import PHASES
    from gspo_lightning.run.progress import LineProgressBar

    bar = LineProgressBar(interval_s=30)
    now = time.monotonic()
    bar._running, bar._last_line = ("step 3/8", now - 65), now - 31
    PHASES.begin("update", total=4, unit="optimizer steps")
    PHASES.advance()
    bar._tick()
    assert re.fullmatch(r"step 3/8  update 1/4 optimizer steps  0:00:00 in this phase, 0:01:0[56] into the step\n",
                        capsys.readouterr().out)
    bar._tick()  # a line was just printed, the step is not known to be slow: nothing
    assert capsys.readouterr().out == ""
    bar._slow = True  # the previous step took longer than interval_s: a line as each phase starts
    PHASES.begin("generating 128 responses")
    PHASES.tokens(12, 32)
    bar._tick()
    assert capsys.readouterr().out.startswith("step 3/8  generating 128 responses, token 12/32  0:00:00 in this phase")
    PHASES.end(None)


def in_a_terminal(args, env_extra, timeout=300) -> str:
    """What ``gspo`` writes to a terminal (a pseudo-terminal, 120 columns), escapes and all."""
    import pty

    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "120", "LINES": "40", **env_extra}
    proc = subprocess.Popen([sys.executable, "-m", "gspo_lightning.cli", *args], cwd=ROOT, env=env,
                            stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=30)
    os.close(master)
    assert proc.returncode == 0, b"".join(chunks)[-3000:]
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_in_a_terminal_the_bar_names_the_phase_of_a_slow_step_and_a_resumed_run_keeps_its_total(tmp_path):
    base = ["fit", "--config", QUICKSTART, f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0", "--model.export_on_fit_end=false",
            '--model.rewards=[{"function": "tests.test_console.slow_successor_reward"}]']
    text = in_a_terminal([*base, "--trainer.max_steps=2"], {"SLOW_REWARD_S": "3"})
    assert "step · generating 128 responses, token 6/6" in text  # the bar's title, after 2 s of a step
    assert "2/2" in text and "Epoch" not in text
    ckpt = tmp_path / "csv" / "version_0" / "checkpoints" / "last.ckpt"
    text = in_a_terminal([*base, "--trainer.max_steps=4", f"--ckpt_path={ckpt}"], {"SLOW_REWARD_S": "0"})
    totals = set(re.findall(r"\b(\d+)/(\d+)\b", text))
    assert ("4", "4") in totals and {total for _, total in totals} == {"4"}, totals


@pytest.mark.slow
def test_wandb_offline_beside_csv_writes_into_the_run_folder_only(tmp_path):
    pytest.importorskip("wandb")
    cwd, run = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    out = gspo("fit", "--config", QUICKSTART, f"--trainer.default_root_dir={run}", "--trainer.max_steps=2",
               "--trainer.val_check_interval=2", "--trainer.logger+=lightning.pytorch.loggers.WandbLogger",
               "--trainer.logger.init_args.offline=true", cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not list(cwd.iterdir()), "the run wrote into the working directory"
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb")), "no offline W&B run in the run folder"
    version = run / "csv" / "version_0"  # CSV first: the run's own files stay where they always are
    for name in ("metrics.csv", "eval_results.jsonl", "config.yaml", "training_curves.png", "hf_model",
                 "checkpoints/last.ckpt", "checkpoints/best.ckpt"):
        assert (version / name).exists(), name
    assert "held-out accuracy: untrained 0 (step 0)" in out.stdout


@pytest.mark.slow
def test_wandb_alone_still_keeps_the_run_in_its_folder(tmp_path):
    pytest.importorskip("wandb")
    cwd, run = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    out = gspo("fit", "--config", QUICKSTART, f"--trainer.default_root_dir={run}", "--trainer.max_steps=2",
               "--trainer.val_check_interval=2", "--trainer.logger=lightning.pytorch.loggers.WandbLogger",
               "--trainer.logger.init_args.offline=true", cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not list(cwd.iterdir()), "the run wrote into the working directory"
    for name in ("eval_results.jsonl", "config.yaml", "training_curves.png", "hf_model/model.safetensors"):
        assert (run / name).exists(), name
    assert list(run.glob("lightning_logs/*/checkpoints/last.ckpt"))


def test_a_hub_id_the_hub_cannot_serve_fails_at_once_in_one_line(tmp_path):
    """No network (here: the hub's address refuses connections): one error line, no retry loop."""
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}  # port 9: nothing listens
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE"):
        env[name] = ""
    start = time.perf_counter()
    proc = gspo("fit", "--config", QUICKSTART, f"--trainer.default_root_dir={tmp_path}",
                "--model.model_name_or_path=gspo-lightning-tests/no-such-model", stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    assert "Retrying" not in err and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("gspo: error:")]
    assert len(errors) == 1 and "cannot load model 'gspo-lightning-tests/no-such-model'" in errors[0]
    assert time.perf_counter() - start < 120  # the retry loop alone took most of a minute


def test_hub_reachable_tries_one_connection():
    import socket

    from gspo_lightning.models.hub import hub_reachable

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert hub_reachable(f"http://127.0.0.1:{server.getsockname()[1]}", timeout=2) is True
    with socket.socket() as closed:  # a port just freed: nothing listens there
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert hub_reachable(f"http://127.0.0.1:{port}", timeout=2) is False
    assert hub_reachable("https://no-such-host.invalid", timeout=2) is False


@pytest.mark.slow
def test_gspo_test_of_a_checkpoint_prints_one_line_with_its_step(tmp_path):
    out = gspo("fit", "--config", QUICKSTART, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=2",
               "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--model.export_on_fit_end=false")
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = tmp_path / "csv" / "version_0" / "checkpoints" / "last.ckpt"
    out = gspo("test", "--config", QUICKSTART, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={ckpt}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.fullmatch(r"test at step 2: accuracy [\d.]+  pass@1 [\d.]+  reward_mean [\d.]+  response_length [\d.]+\n",
                        out.stdout), out.stdout  # no table beside it
    for noise in [*NOISE, "dirpath has changed", "callbacks used to create the checkpoint"]:
        assert noise not in out.stdout + out.stderr, noise
    record = json.loads((tmp_path / "csv" / "version_1" / "eval_results.jsonl").read_text())
    assert record["step"] == 2 and record["policy_version"] == 8


def test_the_end_of_fit_summary_names_untrained_best_and_last():
    from gspo_lightning.run.results import HeldOutResults, format_results

    results = HeldOutResults()
    results.evaluations = [(0, {"val/accuracy": 0.0}), (25, {"val/accuracy": 0.5}), (50, {"val/accuracy": 1.0}),
                           (75, {"val/accuracy": 1.0}), (100, {"val/accuracy": 0.875})]
    assert results.summary() == "held-out accuracy: untrained 0 (step 0) -> best 1 (step 50) -> last 0.875 (step 100)"
    results.evaluations = results.evaluations[1:2]  # a resumed run's first evaluation, alone
    assert results.summary() == "held-out accuracy: first 0.5 (step 25)"
    results.load_state_dict(HeldOutResults().state_dict())
    assert results.summary() is None
    assert format_results({"val/reward_mean": 0.71484375, "val/pass@4": 0.75, "val/accuracy": 0.53125,
                           "val/response_length": 6.0}) == "accuracy 0.531  pass@4 0.75  reward_mean 0.715  response_length 6"


class _Trainer:
    max_steps = 150


def test_progress_lines_every_tenth_of_the_run_or_every_interval():
    from gspo_lightning.run.progress import LineProgressBar

    bar = LineProgressBar(interval_s=30)
    now = bar._last_line + 1  # a line a second ago
    due = [step for step in range(1, 151) if bar.step_due(step, _Trainer(), now)]
    assert due == [1, 15, 30, 45, 60, 75, 90, 105, 120, 135, 150]
    assert bar.step_due(7, _Trainer(), bar._last_line + 30)  # 30 s since the last line
    assert [s for s in range(1, 21) if LineProgressBar(every_n_steps=4).step_due(s, _Trainer(), time.monotonic())] == [1, 4, 8, 12, 16, 20]
    with pytest.raises(ValueError, match="every_n_steps must be at least 1"):
        LineProgressBar(every_n_steps=0)


def test_a_phase_describes_itself():
    from gspo_lightning.rollout.phases import Phase

    assert Phase("log-probs", 0.0).describe() == "log-probs"
    assert Phase("update", 0.0, done=3, total=4, unit="optimizer steps").describe() == "update 3/4 optimizer steps"
    assert Phase("evaluating", 0.0, done=1, total=2, unit="batches", tokens=(5, 6)).describe() == "evaluating 1/2 batches, token 5/6"


def successor_reward_that_fails(prompts, completions, **columns):
    """The quickstart's reward; raises during the step given by ``FAIL_AT_STEP``."""
    from gspo_lightning.data.tasks.successor import successor_reward

    if len(completions) == 128:
        TRAINING_CALLS["n"] += 1
        if TRAINING_CALLS["n"] == int(os.environ["FAIL_AT_STEP"]):
            raise RuntimeError("the grader is down")
    return successor_reward(prompts, completions, **columns)


@pytest.mark.slow
def test_a_reward_error_then_resume_keeps_one_step_numbering(tmp_path):
    run = tmp_path / "run"
    out = gspo(*quickstart(run, "--model.export_on_fit_end=false",
                           '--model.rewards=[{"function": "tests.test_console.successor_reward_that_fails"}]'),
               env={"FAIL_AT_STEP": "13"})
    assert out.returncode == 2 and "the grader is down" in out.stderr
    assert "the run up to step 12 is saved" in out.stdout
    ckpt = run / "csv" / "version_0" / "checkpoints" / "last.ckpt"
    # resumed, the checkpoint's config comes back (the reward function included): fixed, it raises no more
    out = gspo(*quickstart(run, "--model.export_on_fit_end=false", f"--ckpt_path={ckpt}"), env={"FAIL_AT_STEP": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert next(line for line in out.stdout.splitlines() if line.startswith("step ")).startswith("step 13/20  reward")
    assert "exists and is not empty" not in out.stderr
    assert_one_numbering(run, 20, 10)
