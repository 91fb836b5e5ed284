"""The ``gspo`` command end to end on the tiny model: fit, validate, config errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gspo_lightning.cli import main

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
            "rewards": [{"function": "gspo_lightning.tasks.echo.echo_reward"}],
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
    assert len(evals) == 3 and 0.0 <= evals[-1]["val/accuracy"] <= 1.0

    main(["validate", "--config", str(cfg), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt")])
    evals = [json.loads(line) for line in (tmp_path / "csv" / "version_1" / "eval_results.jsonl").read_text().splitlines()]
    assert evals[0]["policy_version"] == 6  # the checkpoint's weights were evaluated


def run_gspo(*args):
    return subprocess.run([sys.executable, "-m", "gspo_lightning.cli", *args], cwd=ROOT, capture_output=True, text=True)


ROLL_SEED = {  # ../shared/GSPO.md section 8
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
    for key, (section, value) in ROLL_SEED.items():
        assert key in config[section], key
        assert config[section][key] == value, (key, config[section][key], value)


def test_unknown_key_fails_naming_it(tmp_path):
    result = run_gspo("fit", "--config", "configs/quickstart.yaml", "--model.clip_hihg=0.1", "--print_config")
    assert result.returncode != 0
    assert "clip_hihg" in result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs/quickstart.yaml").read_text().replace("  response_length: 6", "  response_lenght: 6"))
    result = run_gspo("fit", "--config", str(bad), "--print_config")
    assert result.returncode != 0 and "response_lenght" in result.stderr
