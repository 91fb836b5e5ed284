"""One GSPO optimizer step under a given strategy, launched by torchrun from
tests/test_distributed.py; rank 0 saves the updated weights and the logged metrics.

Rollouts come from a deterministic engine (completions depend only on the prompt), so
1 rank and 2 ranks train on exactly the same global batch.
"""

import argparse
import json
import os
import warnings
from pathlib import Path

import lightning as L
import torch

from gspo_lightning.data.datamodule import PromptDataModule
from gspo_lightning.episodes.messages import StepResult
from gspo_lightning.episodes.multi_turn import MultiTurn
from gspo_lightning.models.lora import LoRA
from gspo_lightning.rewards import RewardSpec
from gspo_lightning.rollout.engine import Generation, RolloutEngine
from gspo_lightning.training.module import GSPOModule
from tests.helpers_episodes import RepliesToEveryTurn


class DeterministicEngine(RolloutEngine):
    """Completions that depend only on (prompt, sample index): lengths 1..5, some ending in EOS."""

    shares_policy_weights = True

    calls = 0  # generate calls: an episode's turns each make one

    def start(self, spec):
        self.vocab_size, self.eos_id, self.pad_id = len(spec.tokenizer), spec.eos_token_ids[0], spec.pad_token_id

    def generate(self, prompt_ids, n, params, seed):
        self.calls += 1
        rows = []
        for prompt in prompt_ids:
            for j in range(n):
                # a response is the first max_new_tokens of a fixed one (1..5 tokens), as a sampler
                # streams it: the same tokens whatever max_new_tokens a caller asks for
                length = 1 + (sum(prompt) * 3 + j * 7) % 5
                row = [3 + (sum(prompt) * 5 + j * 11 + t * 13) % (self.vocab_size - 3) for t in range(length)]
                if j % 3 == 0:
                    row[-1] = self.eos_id
                rows.append(row[:params.max_new_tokens])
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        lengths = torch.tensor([len(r) for r in rows])
        truncated = torch.tensor([r[-1] != self.eos_id for r in rows])
        return Generation(ids, torch.zeros(ids.shape), lengths, truncated)


class GatheringEngine(DeterministicEngine):
    """Gathers a sharded policy's weights in every generate, as HFEngine does: a collective, so
    every rank must call it as often (FSDP2 hangs otherwise)."""

    def start(self, spec):
        super().start(spec)
        self.policy = spec.policy

    def generate(self, prompt_ids, n, params, seed):
        from gspo_lightning.rollout.hf import gathered

        with gathered(self.policy):
            return super().generate(prompt_ids, n, params, seed)


class EndsAtOnceOnRankOne(RepliesToEveryTurn):
    """Replies to every turn on rank 0 (until max_turns); ends every episode at once on rank 1."""

    def step(self, assistant_message):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            return StepResult(messages=[], done=True)
        self.turns = 0  # never done: replies until max_turns or the budget
        return super().step(assistant_message)


# name -> GSPOModule overrides; batch-wide statistics (batch normalization, whitening)
# must be gathered over ranks, group statistics stay on the rank that holds the group
CASES = {
    "seq-mean-token-mean": dict(loss_agg_mode="seq-mean-token-mean"),
    "seq-mean-token-sum": dict(loss_agg_mode="seq-mean-token-sum", reward_norm="group"),
    "token-mean": dict(loss_agg_mode="token-mean", importance_sampling="token", reward_norm="batch", whiten_advantages=True),
    # the load-balancing loss is a mean per micro-batch: one group per micro-batch on either layout
    "moe-aux-loss": dict(model_name_or_path="builtin:tiny-moe-echo", router_aux_loss_coef=0.5, micro_batch_size=4),
    # the frozen reference (sharded like the policy under FSDP2) in a real fit
    "kl-reference": dict(use_kl_loss=True, kl_loss_coef=0.5, kl_estimator="k1"),
    # LoRA: only the adapters train (B moves first: it starts at zero); the reference is the
    # base, the policy with its adapters off
    "lora-kl": dict(lora=LoRA(rank=4, alpha=8), use_kl_loss=True, kl_loss_coef=0.5, kl_estimator="k1"),
    # multi-turn episodes: each rank runs its own episodes, so ranks take different numbers of
    # turns; the environment's tokens sit inside the responses, masked out of the loss
    "episodes": dict(model_name_or_path="builtin:tiny-lookup", data_path="builtin:lookup", response_length=12,
                     episodes=lambda: MultiTurn(RepliesToEveryTurn(), max_turns=3, end_of_turn=""),
                     rewards=[RewardSpec(function="gspo_lightning.data.tasks.lookup.lookup_answer_reward"),
                              RewardSpec(function="gspo_lightning.data.tasks.lookup.lookup_call_reward", weight=0.2)]),
}
# not compared with one rank: its ranks take different numbers of turns on purpose
UNEVEN = dict(CASES["episodes"], episodes=lambda: MultiTurn(EndsAtOnceOnRankOne(), max_turns=3, end_of_turn=""),
              engine=GatheringEngine)


def reward_that_fails_on_rank_one_at_step_two(prompts, completions, **columns):
    """The echo task's reward, raising on rank 1 at its second call (the second step)."""
    from gspo_lightning.data.tasks.echo import echo_reward

    _REWARD_CALLS["n"] += 1
    if torch.distributed.get_rank() == 1 and _REWARD_CALLS["n"] == 2:
        raise ConnectionError("the grader is down")
    return echo_reward(prompts, completions, **columns)


_REWARD_CALLS = {"n": 0}


def run_failing_reward(out_dir: str) -> None:
    """``max_staleness: 0``, 2 ranks, checkpoints on: rank 1's reward function raises at step 2."""
    L.seed_everything(0, verbose=False)
    module = GSPOModule(
        model_name_or_path="builtin:tiny-echo", engine=DeterministicEngine(), num_return_sequences_in_group=4,
        response_length=5, num_mini_batches=1, max_grad_norm=None, optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        rewards=[RewardSpec(function="worker.reward_that_fails_on_rank_one_at_step_two")])
    data = PromptDataModule(path="builtin:echo", tokenizer="builtin:tiny-echo", rollout_batch_size=8, prompt_length=8,
                            val_size=0, shuffle=False)
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp", max_steps=4, logger=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
        limit_val_batches=0, default_root_dir=out_dir,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), save_last=True, save_top_k=0, every_n_train_steps=50)])
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)
    try:
        trainer.fit(module, datamodule=data)
    except Exception as err:  # noqa: BLE001 - what each rank stopped with, for the test
        Path(out_dir, f"stopped-{trainer.global_rank}.txt").write_text(f"{type(err).__name__}: {err}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="also: episodes-uneven, reward-fails-on-rank-1")
    parser.add_argument("--out_dir", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for case in args.cases:
        if case == "reward-fails-on-rank-1":
            run_failing_reward(args.out_dir)
        else:
            run_case(args.strategy, case, args.out_dir)
    # tear the process group down before exit: a gloo thread alive at interpreter
    # shutdown aborts the process ("terminate called without an active exception")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run_case(strategy_name: str, case: str, out_dir: str):
    world = int(os.environ.get("WORLD_SIZE", "1"))

    L.seed_everything(0, verbose=False)
    settings = {"model_name_or_path": "builtin:tiny-echo", "micro_batch_size": 3, "response_length": 5,
                "rewards": [RewardSpec(function="gspo_lightning.data.tasks.echo.echo_reward")],
                **(UNEVEN if case == "episodes-uneven" else CASES[case])}
    data_path = settings.pop("data_path", "builtin:echo")
    if "episodes" in settings:
        settings["episodes"] = settings["episodes"]()  # each run its own (the renderer is built at start)
    engine = settings.pop("engine", DeterministicEngine)()
    module = GSPOModule(
        engine=engine, num_return_sequences_in_group=4, max_grad_norm=None, num_mini_batches=1,
        **settings, optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
    )
    module.configure_model() if strategy_name != "fsdp2" else None
    initial = {k: v.detach().clone() for k, v in module.policy.named_parameters()} if module.policy is not None else {}
    data = PromptDataModule(path=data_path, tokenizer=settings["model_name_or_path"], rollout_batch_size=8,
                            prompt_length=8, val_size=0, shuffle=False)
    strategy = strategy_name
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=out_dir,
    )
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
    trainer.fit(module, datamodule=data)

    state = {}
    for name, param in module.policy.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        state[name] = full.detach().cpu()
    calls = [None] * world  # each rank's generate calls
    if world > 1:
        torch.distributed.all_gather_object(calls, engine.calls)
    else:
        calls = [engine.calls]
    if trainer.global_rank == 0:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith(("time/", "perf/", "cpu/"))}
        out = os.path.join(out_dir, f"{case}.pt")
        torch.save({"state": state, "initial": initial, "metrics": metrics, "world": world,
                    "grad_sync": module.grad_sync.mode, "calls": calls}, out)
        print(json.dumps({"saved": out, "world": world}))


if __name__ == "__main__":
    main()
