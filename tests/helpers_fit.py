"""Helpers of the tests that train: a GSPOModule on the tiny echo task in a real Trainer
(``make_module``, ``fit``), and ``gspo fit`` configs and what a run leaves behind
(``write_config``, ``metric_rows``, ``policy_state``). Reward functions that configs name by
import path (``tests.helpers_fit.reward_by_text``) live here too."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import lightning as L
import torch
import yaml

from gspo_lightning.data.datamodule import PromptDataModule
from gspo_lightning.rewards import RewardSpec
from gspo_lightning.training.module import GSPOModule

ECHO_REWARD = [RewardSpec(function="gspo_lightning.data.tasks.echo.echo_reward")]


def make_module(cls=GSPOModule, **overrides):
    kwargs = dict(
        model_name_or_path="builtin:tiny-echo", rewards=ECHO_REWARD, num_return_sequences_in_group=4,
        response_length=5, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def fit(module, tmp_path, max_steps, rollout_batch_size=4, ckpt_path=None, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    data = PromptDataModule(path="builtin:echo", tokenizer=module.hparams.model_name_or_path,
                            rollout_batch_size=rollout_batch_size, prompt_length=8, val_size=8)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
        enable_checkpointing=trainer_kwargs.pop("enable_checkpointing", False),
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path, **trainer_kwargs,
    )
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def reward_by_text(prompts, completions, **columns):
    """Scores that vary within every group, whatever the policy samples (advantages are never all 0)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


CALLS = {"n": 0}


def reward_that_fails_on_the_third_call(prompts, completions, **columns):
    """Fails on its third call after ``CALLS["n"] = 0`` (the grader is down), then scores again."""
    CALLS["n"] += 1
    if CALLS["n"] == 3:
        raise RuntimeError("the grader is down")
    return [float(len(c) > 0) for c in completions]


def write_config(folder: Path, max_steps: int, response_length: int = 5, **model) -> Path:
    config = {
        "seed_everything": 11,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": max_steps, "limit_val_batches": 0,
            "default_root_dir": str(folder), "enable_progress_bar": False, "enable_model_summary": False,
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(folder), "name": "csv"}}],
        },
        "checkpoint": {"dirpath": str(folder / "ckpt"), "every_n_train_steps": 1},
        "model": {
            "model_name_or_path": "builtin:tiny-echo",
            "rewards": [{"function": "gspo_lightning.data.tasks.echo.echo_reward"}],
            "num_return_sequences_in_group": 4, "response_length": response_length,
            "reward_norm": "running", "mini_batch_size": 8, "ppo_epochs": 1,
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.003}},
            "lr_scheduler": {"class_path": "torch.optim.lr_scheduler.LinearLR",
                             "init_args": {"start_factor": 1.0, "end_factor": 0.2, "total_iters": 12}},
            **model,
        },
        "data": {"path": "builtin:echo", "rollout_batch_size": 4, "prompt_length": 8, "val_size": 0},
    }
    path = folder / "cfg.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def metric_rows(folder: Path) -> dict[float, dict[str, str]]:
    """policy_version -> logged row, over all runs in the folder, without wall-clock and machine-load
    metrics (``cpu/``: the thread rule times its own first steps, so a resumed process may pick
    another count for a while) and without values not measured at that step (NaN: a resumed
    process has not seen the key yet)."""
    rows = {}
    for file in sorted(folder.glob("csv/version_*/metrics.csv")):
        with open(file) as handle:
            for row in csv.DictReader(handle):
                if row.get("policy_version"):
                    rows[float(row["policy_version"])] = {
                        k: v for k, v in row.items() if v and v != "nan" and not k.startswith(("time/", "perf/", "cpu/")) and k != "step"}
    return rows


def policy_state(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("policy.")}


def constant_reward(prompts, completions, **columns):
    """The same score for everything (a judge that never parses, say): no learning signal."""
    return [0.0] * len(completions)
