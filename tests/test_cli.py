"""The ``gspo`` command end to end on the tiny model: fit, validate, config errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gspo_lightning.cli import main
from gspo_lightning.training.config import BLOCK_OF

ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path) -> Path:
    config = {
        "seed_everything": 3,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 6, "val_check_interval": 2,
            "default_root_dir": str(tmp_path), "enable_progress_bar": False, "enable_model_summary": False,
            "logger": [
                {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path), "name": "csv"}},
                {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(tmp_path), "name": "tensorboard"}},
            ],
        },
        "checkpoint": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 2},
        "model": {
            "model_name_or_path": "builtin:tiny-echo",
            "rewards": [{"function": "gspo_lightning.data.tasks.echo.echo_reward"}],
            "num_return_sequences_in_group": 4, "response_length": 5,
            "val_num_samples": 2, "val_temperature": 1.0,
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.003}},
        },
        "data": {"path": "builtin:echo", "rollout_batch_size": 4, "prompt_length": 8, "val_size": 8},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_fit_then_validate_through_the_cli(tmp_path):
    cfg = write_config(tmp_path)
    main(["fit", "--config", str(cfg)])
    run = tmp_path / "csv" / "version_0"
    metrics = (run / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    for key in ("reward/mean", "loss/clip_frac", "time/generate", "val/reward_mean", "val/pass@2"):
        assert key in header, key
    assert len(metrics) > 6
    assert (run / "training_curves.png").stat().st_size > 10_000
    assert list((tmp_path / "tensorboard" / "version_0").glob("events.out.tfevents.*")), "TensorBoard events missing"
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    evals = [json.loads(line) for line in (run / "eval_results.jsonl").read_text().splitlines()]
    # every 2 rollout steps, each of 4 optimizer steps (the default num_mini_batches)
    assert [(e["step"], e["policy_version"]) for e in evals] == [(2, 8), (4, 16), (6, 24)]
    for e in evals:
        # 2 samples per prompt: pass@1 is the share correct; pass@2, the share of prompts with one
        # correct, lies between it and twice it. A correct echo scores 1, so the mean reward is at least it.
        assert e["val/pass@1"] == e["val/accuracy"] <= e["val/pass@2"] <= 2 * e["val/accuracy"]
        assert e["val/reward_mean"] >= e["val/accuracy"] and 1 <= e["val/response_length"] <= 5

    main(["validate", "--config", str(cfg), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt")])
    evals = [json.loads(line) for line in (tmp_path / "csv" / "version_1" / "eval_results.jsonl").read_text().splitlines()]
    # the checkpoint's weights were evaluated: 6 rollout steps of 4 optimizer steps
    assert evals[0]["policy_version"] == 24


def run_gspo(*args):
    return subprocess.run([sys.executable, "-m", "gspo_lightning.cli", *args], cwd=ROOT, capture_output=True, text=True)


ROLL_SEED = {  # ROLL's seed keys: docs/algorithm.md, "ROLL's seed keys, here"
    "adv_estimator": ("model", "reinforce"), "importance_sampling": ("model", "seq"),
    "rollout_batch_size": ("data", 64), "num_return_sequences_in_group": ("model", 8),
    "prompt_length": ("data", 2048), "response_length": ("model", 4096), "ppo_epochs": ("model", 1),
    "use_kl_loss": ("model", True), "kl_loss_coef": ("model", 0.001), "loss_agg_mode": ("model", "seq-mean-token-sum"),
    "whiten_advantages": ("model", True), "advantage_clip": ("model", 2.0), "dual_clip_loss": ("model", True),
    "reward_clip": ("model", 10), "reward_norm": ("model", None), "reward_shift": ("model", False),
    "reward_scale": ("model", False), "add_token_level_kl": ("model", False),
}


def test_print_config_shows_every_roll_seed_key_with_its_value():
    result = run_gspo("fit", "--config", "configs/roll_gspo_example.yaml", "--print_config")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    # the flat keys (the example keeps ROLL's spelling) land in their blocks, with ROLL's values
    model = config["model"]
    assert model["objective"]["policy_loss"]["init_args"]["dual_clip"] == 3.0  # dual_clip_loss: true, our constant
    for key, (section, value) in ROLL_SEED.items():
        if key == "dual_clip_loss":
            continue
        found = config[section] if section == "data" else model[BLOCK_OF[key]]
        assert key in found, key
        assert found[key] == value, (key, found[key], value)


def test_unknown_key_fails_naming_it(tmp_path):
    result = run_gspo("fit", "--config", "configs/quickstart.yaml", "--model.clip_hihg=0.1", "--print_config")
    assert result.returncode != 0
    assert "clip_hihg" in result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs/quickstart.yaml").read_text().replace("  response_length: 6", "  response_lenght: 6"))
    result = run_gspo("fit", "--config", str(bad), "--print_config")
    assert result.returncode != 0 and "response_lenght" in result.stderr


# --- errors a user can make: one short message with the fix, exit status 2 ----------------

def test_config_error_is_one_message_with_exit_status_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(write_config(tmp_path)), "--model.ppo_epochs=0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "gspo: error: invalid GSPO configuration" in err and "ppo_epochs must be >= 1" in err
    assert "Traceback" not in err and "--debug" in err
    assert len(err.strip().splitlines()) <= 6


@pytest.mark.parametrize("switch", ["env", "flag"])
def test_debug_switch_shows_the_traceback(tmp_path, monkeypatch, switch):
    args = ["fit", "--config", str(write_config(tmp_path)), "--model.ppo_epochs=0"]
    if switch == "env":
        monkeypatch.setenv("GSPO_DEBUG", "1")
    else:
        args.append("--debug")
    with pytest.raises(ValueError, match="ppo_epochs must be >= 1"):
        main(args)


def test_unexpected_errors_keep_their_traceback(monkeypatch):
    import gspo_lightning.run.command as cli

    def internal_bug(*args, **kwargs):
        raise RuntimeError("an internal error")

    monkeypatch.setattr(cli, "GSPOCLI", internal_bug)
    with pytest.raises(RuntimeError, match="an internal error"):
        main(["fit"])
    monkeypatch.setattr(cli, "GSPOCLI", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        main(["fit"])


def test_a_value_error_from_inside_a_library_keeps_its_traceback(monkeypatch):
    """Only our own error types are the user's: a ValueError deep in torch or transformers is a bug
    to report, shown with its traceback, not one line that hides where it came from."""
    import gspo_lightning.run.command as cli

    def library_bug(*args, **kwargs):
        raise ValueError("Expected 3D tensor, got 2D")

    monkeypatch.setattr(cli, "GSPOCLI", library_bug)
    with pytest.raises(ValueError, match="Expected 3D tensor"):
        main(["fit"])


def test_the_optimizers_own_checks_name_the_key(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(write_config(tmp_path)), "--model.optimizer.init_args.lr=-0.001"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "gspo: error: model.optimizer: Invalid learning rate: -0.001; change it in model.optimizer.init_args" in err


def test_a_missing_optional_package_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError, as when it is not installed
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(write_config(tmp_path)), "--model.lora.rank=4"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) <= 3
    assert "gspo: error: model.lora needs the peft package: pip install 'gspo-lightning[lora]'" in err


def test_batch_sizes_that_cannot_divide_a_step_fail_before_any_model_loads(tmp_path, capsys):
    # the model folder does not exist either: the sizes are checked first, when the config is read
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(write_config(tmp_path)), "--model.update.mini_batch_size=7",
              f"--model.model_name_or_path={tmp_path / 'no_model'}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "mini_batch_size=7 must be a multiple of the 1 rank(s) and divide" in err
    assert "does not exist" not in err


def test_non_finite_stop_is_an_expected_error(monkeypatch, capsys):
    import gspo_lightning.run.command as cli
    from gspo_lightning.errors import NonFiniteError

    def diverged(*args, **kwargs):
        raise NonFiniteError("3 updates in a row had a non-finite loss or gradient. Lower the learning rate")

    monkeypatch.setattr(cli, "GSPOCLI", diverged)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit"])
    assert exit_info.value.code == 2 and "gspo: error: 3 updates in a row" in capsys.readouterr().err


def test_missing_model_folder_is_a_short_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(write_config(tmp_path)), f"--model.model_name_or_path={tmp_path / 'no_model'}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "does not exist" in err and "Qwen/Qwen3-1.7B" in err
    assert "Repo id" not in err and len(err.strip().splitlines()) <= 3


def test_empty_data_file_says_so_and_leaves_no_version_folders(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(write_config(tmp_path)), f"--data.path={tmp_path / 'empty.jsonl'}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "empty.jsonl has no rows" in err and "val_size" not in err
    assert not list(tmp_path.glob("*/version_*")), "a failed start left a version folder"
    assert not (tmp_path / "csv").exists() and not (tmp_path / "tensorboard").exists(), "a failed start left empty folders"


def test_predict_is_not_offered():
    result = run_gspo("predict", "--help")
    assert result.returncode != 0 and "invalid choice: 'predict'" in result.stderr


def test_test_scores_its_own_file_and_needs_one(tmp_path, capsys):
    cfg = str(write_config(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--config", cfg])
    assert exit_info.value.code == 2 and "set data.test_path" in capsys.readouterr().err
    test_file = tmp_path / "test.jsonl"
    test_file.write_text("".join(json.dumps({"prompt": f"repeat {d}", "target": str(d)}) + "\n" for d in range(3)))
    main(["test", "--config", cfg, f"--data.test_path={test_file}"])
    record = json.loads((tmp_path / "csv" / "version_0" / "eval_results.jsonl").read_text().splitlines()[-1])
    assert "test/accuracy" in record and "val/accuracy" not in record


@pytest.mark.slow
def test_checkpointing_off_means_no_checkpoints(tmp_path):
    main(["fit", "--config", str(write_config(tmp_path)), "--trainer.enable_checkpointing=false",
          "--trainer.max_steps=1", "--trainer.limit_val_batches=0"])
    assert (tmp_path / "csv" / "version_0" / "metrics.csv").exists()
    assert not list(tmp_path.rglob("*.ckpt"))


MY_REWARDS = '''
def score(prompts, completions, target, **columns):
    """1.0 for each word of the completion that is the target digit, over 4 words."""
    return [sum(word == digit for word in completion.split()[:4]) / 4 for completion, digit in zip(completions, target)]


def broken(prompts, completions, **columns):
    raise KeyError("no such column")
'''


@pytest.mark.slow
def test_reward_module_in_the_working_directory_imports_with_the_gspo_command(tmp_path):
    (tmp_path / "myrewards.py").write_text(MY_REWARDS)
    gspo = Path(sys.executable).parent / "gspo"  # the console script: its sys.path lacks the working directory
    cfg = str(write_config(tmp_path))
    base = [str(gspo), "fit", "--config", cfg, "--trainer.max_steps=1", "--trainer.limit_val_batches=0"]
    result = subprocess.run(base + ['--model.rewards=[{"function": "myrewards.score"}]'], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "reward/score" in (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]

    result = subprocess.run(base + ['--model.rewards=[{"function": "myrewards.broken"}]'], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "gspo: error: reward function 'broken': raised KeyError" in result.stderr
    assert "Traceback" not in result.stderr


# -- the entry point parses before it imports ------------------------------------------------------
ENTRY_PROBE = """
import sys, time
start = time.perf_counter()
from gspo_lightning.cli import main
try:
    main(sys.argv[1:])
except SystemExit as stop:
    assert stop.code in (0, None), stop.code
heavy = sorted(m for m in ("torch", "lightning", "transformers") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), "SECONDS=%.3f" % (time.perf_counter() - start))
"""


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--version"], ["serve", "--help"], ["fit", "--help"]])
def test_help_and_serve_help_import_neither_torch_nor_lightning(argv):
    out = subprocess.run([sys.executable, "-c", ENTRY_PROBE, *argv], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    heavy = out.stdout.rsplit("HEAVY=", 1)[1].split()[0] if not out.stdout.rsplit("HEAVY=", 1)[1].startswith(" ") else ""
    assert heavy == "", f"imported {heavy} before dispatching"
    assert float(out.stdout.rsplit("SECONDS=", 1)[1]) < 1.0
    assert ("gspo-lightning 0.1" if argv == ["--version"] else "usage: gspo") in out.stdout


def test_no_command_prints_the_commands_and_fails(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2 and "fit" in capsys.readouterr().out


def test_short_engine_path_is_the_defined_class():
    from gspo_lightning.rollout import VLLMEngine
    from gspo_lightning.rollout.vllm import VLLMEngine as defined

    assert VLLMEngine is defined
