"""A few GSPO steps under a given strategy with rollouts from a colocated Hugging Face engine or
from a rollout server that rank 0 starts (``RemoteEngine(urls=None)``), launched by torchrun
from tests/test_rollout_server.py (or from a ``gspo serve`` the test started, through vLLM's routes:
``StockVLLMEngine``). Rank 0 saves the final weights, the rewards of every
step and, for the server run, the checksum the server reports after a last push next to
the checksum of the trainer's full weights."""

import argparse
import hashlib
import os
import warnings

import lightning as L
import torch

from gspo_lightning.data.datamodule import PromptDataModule
from gspo_lightning.training.module import GSPOModule
from gspo_lightning.rewards import RewardSpec
from gspo_lightning.rollout import HFEngine, RemoteEngine, StockVLLMEngine
from gspo_lightning.rollout.remote import request_json
from gspo_lightning.rollout.weight_sync import iter_policy_weights


class Rewards(L.Callback):
    def __init__(self):
        self.rewards = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rewards.append(float(trainer.callback_metrics["reward/mean"]))


class FinalPush(L.Callback):
    """At the end of training (before teardown closes the engine and its server): the final
    weights, pushed once more, and the checksum the server then reports."""

    def __init__(self, engine):
        self.engine, self.result = engine, {}

    def on_train_end(self, trainer, module):
        full = [(name, tensor.clone()) for name, tensor in iter_policy_weights(module.policy)]  # a collective (FSDP2)
        module.worker.sync_weights(module.policy_version + 1, lambda: iter_policy_weights(module.policy))
        if trainer.global_rank == 0:
            info = request_json(self.engine.urls[0], "/info", secret=self.engine.secret)
            self.result.update(server_checksum=info["checksum"], server_version=info["version"],
                               trainer_checksum=naive_checksum(full))


def naive_checksum(pairs):
    """sha256 over name|dtype|shape|bytes, written out here (not the product's WeightsChecksum)."""
    digest = hashlib.sha256()
    for name, tensor in pairs:
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{str(data.dtype).split('.')[-1]}|{tuple(data.shape)}|".encode())
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--engines", nargs="+", choices=["colocated", "server", "stock"], default=["colocated", "server"],
                        help="runs in this order; a repeated name saves <name>_again.pt")
    parser.add_argument("--out_dir", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for index, engine in enumerate(args.engines):  # one launch: process start-up dominates
        again = engine in args.engines[:index]  # a repeated run: must equal the first bitwise
        run(args.strategy, engine, args.out_dir, f"{engine}_again" if again else engine)
    # tear the process group down before exit (a gloo thread alive at shutdown aborts the process)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run(strategy_name: str, engine_name: str, out_dir: str, save_as: str):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    L.seed_everything(3, verbose=False)
    if engine_name == "stock":  # vLLM's routes, on the gspo serve the test started ($GSPO_TEST_STOCK_URL)
        engine = StockVLLMEngine(base_urls=[os.environ["GSPO_TEST_STOCK_URL"]], api_key_env="GSPO_SERVER_TOKEN")
    else:
        engine = HFEngine() if engine_name == "colocated" else RemoteEngine(urls=None, start_timeout_s=120)
    module = GSPOModule(
        model_name_or_path="builtin:tiny-successor", export_on_fit_end=False, rewards=[RewardSpec(function="gspo_lightning.data.tasks.successor.successor_reward")],
        engine=engine, num_return_sequences_in_group=4, response_length=5, num_mini_batches=1, rollout_seed=11,
        optimizer=lambda p: torch.optim.AdamW(p, lr=0.01),
    )
    data = PromptDataModule(path="builtin:successor", tokenizer="builtin:tiny-successor", rollout_batch_size=8,
                            prompt_length=8, val_size=0, shuffle=False)
    strategy = strategy_name
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    rewards = Rewards()
    final = FinalPush(engine)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=3, logger=False,
        callbacks=[rewards] + ([final] if engine_name == "server" else []),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=out_dir,
    )
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
    trainer.fit(module, datamodule=data)

    full = [(name, tensor.clone()) for name, tensor in iter_policy_weights(module.policy)]  # a collective (FSDP2)
    result = {"state": {name: t for name, t in full}, "rewards": rewards.rewards, "world": world}
    result.update(final.result)
    assert not module.worker.started, "the end of fit closes the engine (and the server it started)"
    if trainer.global_rank == 0:
        torch.save(result, os.path.join(out_dir, f"{save_as}.pt"))


if __name__ == "__main__":
    main()
