"""Asynchronous GSPO (``max_staleness: k``) on the ranks torchrun starts (``k = 0``: the
synchronous loop with dynamic sampling): for each ``k``, a
straight run of ``--steps`` steps, a run stopped after ``--stop_at`` steps (checkpoint every
step) and its resume to ``--steps``. Each rank saves, per run, the final weights, the metrics
logged at every step and the checkpoint's per-rank rollouts; tests/test_async_distributed.py
compares them.

Each rank samples its own prompts (its share of the batch) with its own seed, so the ranks'
rollouts, pending queues and sampling differ: a resume that restores rank 0's queue on
every rank trains other rollouts (or stops: the queue answers other prompts).
"""

import argparse
import os
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from gspo_lightning.data.datamodule import PromptDataModule
from gspo_lightning.objective.offpolicy import OffPolicyCorrection
from gspo_lightning.rewards import RewardSpec
from gspo_lightning.rollout import HFCopyEngine
from gspo_lightning.training.module import GSPOModule


class StepMetrics(L.Callback):
    """Every step's logged metrics on this rank, without wall-clock ones."""

    def __init__(self):
        self.rows = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows[pl_module.rollout_steps] = {
            k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith(("time/", "perf/", "cpu/")) and k != "step_s"}


def any_echo_reward(prompts, completions, target, **columns) -> list[float]:
    """1 when some judged word echoes the target: many groups of the untrained model score all 0."""
    from gspo_lightning.data.tasks.echo import echo_reward

    return [float(score > 0) for score in echo_reward(prompts, completions, target)]


# k -> what that run adds; k = 0 is the synchronous loop with dynamic sampling, whose extra
# prompt stream's position differs between ranks (each generates its own extra rounds)
SETTINGS = {0: {"dynamic_sampling": True, "max_sampling_rounds": 2,
                "rewards": [RewardSpec(function="async_worker.any_echo_reward")]}}


def run(k: int, steps: int, folder: str, ckpt_path=None, engine=None) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    L.seed_everything(5, verbose=False)
    settings = {"rewards": [RewardSpec(function="gspo_lightning.data.tasks.echo.echo_reward")], **SETTINGS.get(k, {})}
    module = GSPOModule(
        model_name_or_path="builtin:tiny-echo", **settings,
        engine=engine or HFCopyEngine(dtype="float32"), num_return_sequences_in_group=4, response_length=5, num_mini_batches=2,
        max_staleness=k, off_policy=OffPolicyCorrection(mode="decoupled"), export_on_fit_end=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    data = PromptDataModule(path="builtin:echo", tokenizer="builtin:tiny-echo", rollout_batch_size=4, prompt_length=8,
                            val_size=0)
    metrics = StepMetrics()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy="ddp", max_steps=steps, logger=False,
        callbacks=[metrics, ModelCheckpoint(dirpath=os.path.join(folder, "ckpt"), save_last=True, every_n_train_steps=1)],
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=folder,
    )
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return {"state": {n: p.detach().clone() for n, p in module.policy.named_parameters()}, "metrics": metrics.rows}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--stop_at", type=int, default=2)
    parser.add_argument("--stop_at_dynamic", type=int, default=3, help="k = 0's stop (where the ranks' extra rounds differ)")
    parser.add_argument("--remote", action="store_true",
                        help="also a straight k = 1 run from a rollout server rank 0 starts (weights pushed by the producer)")
    parser.add_argument("--out_dir", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    for k in args.ks:  # one launch: process start-up dominates
        base = os.path.join(args.out_dir, f"k{k}")
        straight = run(k, args.steps, os.path.join(base, "straight"))
        stopped_dir = os.path.join(base, "stopped")
        stopped = run(k, args.stop_at_dynamic if k == 0 else args.stop_at, stopped_dir)
        ckpt = os.path.join(stopped_dir, "ckpt", "last.ckpt")
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)
        resumed = run(k, args.steps, stopped_dir, ckpt_path=ckpt)
        torch.save({"straight": straight, "stopped": stopped, "resumed": resumed, "checkpoint_gspo": saved["gspo"],
                    "checkpoint_data": saved.get("PromptDataModule"),
                    "world": int(os.environ.get("WORLD_SIZE", "1"))}, os.path.join(base, f"rank{rank}.pt"))
    if args.remote:
        from gspo_lightning.rollout import RemoteEngine

        remote = run(1, args.steps, os.path.join(args.out_dir, "remote"), engine=RemoteEngine(urls=None, start_timeout_s=120))
        torch.save({"straight": remote}, os.path.join(args.out_dir, f"remote_rank{rank}.pt"))
    # tear the process group down before exit (a gloo thread alive at shutdown aborts the process)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
