"""The ``gspo`` command: ``gspo fit|validate|test --config cfg.yaml [--model.key=value ...]``.

Every constructor argument of ``GSPOModule``, ``PromptDataModule`` and ``Trainer`` is a
config key; an unknown key is an error naming it; ``--print_config`` shows the result.
"""

from __future__ import annotations

import sys
from typing import Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

TRAINER_DEFAULTS = {
    "max_steps": 100,
    "log_every_n_steps": 1,
    "num_sanity_val_steps": 0,
    # the prompt stream shards itself over ranks and is resumable
    "use_distributed_sampler": False,
}


class GSPOCLI(LightningCLI):
    """LightningCLI over GSPOModule and PromptDataModule, with CSV + TensorBoard logging and
    a ``checkpoint:`` section (``ModelCheckpoint``: ``last.ckpt`` every 50 steps by default)."""

    def add_arguments_to_parser(self, parser) -> None:
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
        from jsonargparse import lazy_instance

        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({
            "checkpoint.save_last": True,
            "checkpoint.every_n_train_steps": 50,
            "checkpoint.save_top_k": 0,
            "trainer.logger": [
                # separate names: two loggers under one name pick different version folders
                lazy_instance(CSVLogger, save_dir="runs", name="csv"),
                lazy_instance(TensorBoardLogger, save_dir="runs", name="tensorboard"),
            ],
        })


# Warnings that say nothing actionable for a GSPO run.
QUIET = [
    ".*Using ModelCheckpoint with manual optimization.*",  # GSPO steps the optimizer itself, by design
    ".*does not have many workers.*",  # prompts are in memory; rollouts dominate a step
    ".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*",
]


def main(args: Optional[list[str]] = None) -> None:
    import warnings

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from gspo_lightning.data import PromptDataModule
    from gspo_lightning.module import GSPOModule
    from gspo_lightning.preemption import Preempted

    for pattern in QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    try:
        GSPOCLI(
            GSPOModule,
            PromptDataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            args=args,
            auto_configure_optimizers=False,
        )
    except Preempted as stop:
        print(f"gspo: {stop}", file=sys.stderr)
    except SIGTERMException:
        # PreemptionCheckpoint wrote last.ckpt at the step boundary before Lightning raised this
        print("gspo: stopped by SIGTERM after writing last.ckpt; resume with --ckpt_path <checkpoint dir>/last.ckpt", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
