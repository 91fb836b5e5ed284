"""The user path: ``--trainer.default_root_dir`` moves logs and checkpoints in every shipped
config, and what the run prints names steps (not epochs) and no zero FLOP count."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_lightning.run.command import GSPOCLI
from gspo_lightning.data.datamodule import PromptDataModule
from gspo_lightning.training.module import GSPOModule

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))
SCALE = sorted((ROOT / "configs" / "scale").glob("*.yaml"))


class ParseOnly(GSPOCLI):
    """The CLI up to the point where it would build the model (hub models stay unloaded)."""

    def instantiate_classes(self) -> None:
        pass


def parsed(*args):
    return ParseOnly(GSPOModule, PromptDataModule, run=False, args=list(args), auto_configure_optimizers=False).config


@pytest.mark.parametrize("config", SHIPPED + SCALE, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_logs_under_default_root_dir(config, tmp_path):
    args = ["--config", str(config)]
    if config.parent.name == "scale":  # overlays: a base recipe plus the strategy
        args = ["--config", str(ROOT / "configs/quickstart.yaml"), *args]
    cfg = parsed(*args, f"--trainer.default_root_dir={tmp_path}")
    loggers = cfg.trainer.logger
    assert loggers, "no loggers"
    assert [str(entry.init_args.save_dir) for entry in loggers] == [str(tmp_path)] * len(loggers)
    assert cfg.checkpoint.dirpath is None  # checkpoints go to the first logger's version folder


def test_an_explicit_save_dir_is_kept(tmp_path):
    cfg = parsed("--config", str(ROOT / "configs/gsm8k_cpu_smoke.yaml"), f"--trainer.default_root_dir={tmp_path / 'a'}",
                 f"--trainer.logger.init_args.save_dir={tmp_path / 'b'}")
    assert str(cfg.trainer.logger[0].init_args.save_dir) == str(tmp_path / "b")


def test_no_default_root_dir_means_runs():
    cfg = parsed("--model.rewards=[{function: gspo_lightning.data.tasks.echo.echo_reward}]")
    assert [str(e.init_args.save_dir) for e in cfg.trainer.logger] == ["runs", "runs"]


@pytest.mark.slow
def test_fit_writes_under_default_root_dir_and_prints_steps_not_epochs(tmp_path):
    """Through the `gspo` command from another folder: nothing under the working directory,
    metrics and last.ckpt under the run folder; the bar says "step", no "Epoch", no FLOPs."""
    cwd, run = tmp_path / "cwd", tmp_path / "my_run"
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    out = subprocess.run(
        [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / "configs/quickstart.yaml"),
         f"--trainer.default_root_dir={run}", "--trainer.max_steps=2", "--trainer.num_sanity_val_steps=0",
         "--trainer.limit_val_batches=0", "--model.export_on_fit_end=false"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not list(cwd.iterdir()), "the run wrote into the working directory"
    assert (run / "csv" / "version_0" / "metrics.csv").is_file()
    assert (run / "csv" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert list((run / "tensorboard" / "version_0").glob("events.out.tfevents.*"))
    text = out.stdout + out.stderr
    assert "Epoch" not in text and "FLOPs" not in text, text[-3000:]
    assert "step" in text and "2/2" in text
    assert "policy     LlamaForCausalLM" in text and "16 prompts x 8 responses = 128 responses" in text


def test_a_checkpoint_from_before_the_layout_continues_its_log_folder(tmp_path):
    """A checkpoint written by 0.1 names its logger ``gspo_lightning.loggers.CSVLogger``: resumed
    today (``gspo_lightning.run.loggers.CSVLogger``) the run still writes into the same version."""
    import torch
    from jsonargparse import Namespace

    from gspo_lightning.run.command import continue_log_versions, current_class_path

    assert current_class_path("gspo_lightning.loggers.CSVLogger") == "gspo_lightning.run.loggers.CSVLogger"
    assert current_class_path("mypackage.MyLogger") == "mypackage.MyLogger"
    ckpt = tmp_path / "last.ckpt"
    torch.save({"gspo": {"loggers": [{"class": "gspo_lightning.loggers.CSVLogger", "save_dir": str(tmp_path),
                                      "name": "csv", "version": 3}]}}, ckpt)
    entry = Namespace(class_path="gspo_lightning.run.loggers.CSVLogger",
                      init_args=Namespace(save_dir=str(tmp_path), name="csv", version=None))
    continue_log_versions([entry], str(ckpt))
    assert entry.init_args.version == 3
