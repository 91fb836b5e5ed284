"""The training command: ``gspo fit|validate|test --config cfg.yaml [--model.key=value ...]``
(``gspo_lightning/cli.py`` dispatches here; ``gspo serve`` goes to ``run/serve.py``).

Every constructor argument of ``GSPOModule``, ``PromptDataModule`` and ``Trainer`` is a
config key; an unknown key is an error naming it; ``--print_config`` shows the result.
Expected errors (a bad config value, a missing file, a failing reward function) print one
short message with its fix and exit with status 2; ``--debug`` or ``GSPO_DEBUG=1`` shows
the traceback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from gspo_lightning.errors import ConfigError

TRAINER_DEFAULTS = {
    "max_steps": 100,
    "log_every_n_steps": 1,
    "num_sanity_val_steps": 0,
    # the prompt stream shards itself over ranks and is resumable
    "use_distributed_sampler": False,
}

# files a run writes before it does anything: a run that failed with only these wrote nothing
START_FILES = ("config.yaml", "hparams.yaml", "events.out.tfevents.")


class GSPOCLI(LightningCLI):
    """LightningCLI over GSPOModule and PromptDataModule, with CSV + TensorBoard logging and
    a ``checkpoint:`` section (``ModelCheckpoint``: ``last.ckpt`` every 50 rollout steps by default,
    and at the end of fit: see ``run/preemption.py``)."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # no `predict`: a GSPO module has no forward to predict with
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def add_arguments_to_parser(self, parser) -> None:
        from jsonargparse import Namespace
        from jsonargparse.typing import PositiveFloat

        # a plain class group (not add_lightning_class_args): instantiate_trainer adds the callback
        # itself, and only when checkpointing is on
        parser.add_class_arguments(ModelCheckpoint, "checkpoint", fail_untyped=False, sub_configs=True)
        parser.add_argument("--export", choices=["last", "best"], default="last",
                            help="the policy exported at the end of fit (model.export_on_fit_end): the last step's, or "
                                 "the best held-out evaluation's (val/accuracy), kept as best.ckpt beside last.ckpt")
        parser.add_argument("--stop_grace_s", type=PositiveFloat, default=10.0,
                            help="seconds a SIGTERM or Ctrl-C stop may take: a step still generating is abandoned, one in "
                                 "its update finishes, then last.ckpt is written (docker stop waits 10 s, then kills)")
        parser.set_defaults({
            "checkpoint.save_last": True,
            "checkpoint.every_n_train_steps": 50,
            "checkpoint.save_top_k": 0,
            # a resumed run overwrites the last.ckpt it resumed from, not last-v1.ckpt beside it
            "checkpoint.enable_version_counter": False,
            "trainer.logger": [
                # separate names: two loggers under one name pick different version folders
                # save_dir left out: the run folder, trainer.default_root_dir (run_folder_loggers)
                Namespace(class_path="gspo_lightning.run.loggers.CSVLogger", init_args=Namespace(name="csv")),
                Namespace(class_path="gspo_lightning.run.loggers.TensorBoardLogger", init_args=Namespace(name="tensorboard")),
            ],
        })
        # one value, stated once: the data module tokenizes with the model's tokenizer, and
        # the module checks its batch sizes against the data module's
        parser.link_arguments(("model.model_name_or_path", "model.policy.gguf_file"), "data.tokenizer", compute_fn=tokenizer_source)
        parser.link_arguments("data.prompt_length", "model.rollout.prompt_length")
        parser.link_arguments("data.rollout_batch_size", "model.rollout.rollout_batch_size")
        # episodes render their prompts themselves: the data module's chat-template settings do not apply
        parser.link_arguments("model.episodes", "data.episodes", compute_fn=lambda episodes: episodes is not None)
        # a verifiers environment's tasks are the prompts (data.path: verifiers)
        parser.link_arguments("model.episodes", "data.verifiers", compute_fn=verifiers_tasks)

    def parse_arguments(self, parser, args) -> None:
        # the flat model keys of earlier releases, in configs and on the command line: into their blocks
        if args is None or isinstance(args, list):
            from gspo_lightning.run.flat_keys import translate_args

            given = args
            args, note = translate_args(list(sys.argv[1:] if args is None else args))
            if note:
                print(note, file=sys.stderr)
            elif given is None:
                args = None  # nothing was old: parse sys.argv as Lightning does
        import warnings

        with warnings.catch_warnings():  # translated arguments are the command line's, not a second set
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            super().parse_arguments(parser, args)

    def _prepare_subcommand_parser(self, klass, subcommand: str, **kwargs):
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        # checkpoints hold tensors and plain values only: load them without running pickled code
        # (and without torch's warning that weights_only was not set)
        if any(getattr(a, "dest", None) == "weights_only" for a in parser._actions):
            parser.set_defaults(weights_only=True)
        if any(getattr(a, "dest", None) == "verbose" for a in parser._actions):
            parser.set_defaults(verbose=False)  # validate / test: run/results.py prints the results in one line
        return parser

    def before_instantiate_classes(self) -> None:
        trainer = (self.config[self.subcommand] if self.subcommand else self.config).trainer
        run_folder_loggers(trainer.logger, trainer.default_root_dir)
        if self.subcommand == "fit" and self.config.fit.get("ckpt_path"):
            continue_log_versions(self.config.fit.trainer.logger, self.config.fit.ckpt_path)

    def instantiate_trainer(self, **kwargs):
        from lightning.pytorch.callbacks import ModelSummary, ProgressBar

        from gspo_lightning.run.progress import RichStepProgressBar, progress_bar_for
        from gspo_lightning.run.summary import RichRunSummary, RunSummary

        config = self.config_init.get(str(self.subcommand), self.config_init)
        trainer = {**config.get("trainer", {}), **kwargs}
        callbacks = trainer.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        # our bar and summary from the start (Lightning's would be replaced by attach_run_callbacks,
        # with a message saying so): step bar in a terminal, plain lines in a log
        if trainer.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(progress_bar_for())
        if trainer.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in callbacks):
            rich = any(isinstance(c, RichStepProgressBar) for c in callbacks)
            callbacks.append(RichRunSummary() if rich else RunSummary())
        if self.subcommand in ("validate", "test"):
            # nothing to save, and no checkpoint callback to warn that its folder is not the checkpoint's
            kwargs["enable_checkpointing"] = False
        # --trainer.enable_checkpointing=false means no checkpoints, not a clash with ours
        elif trainer.get("enable_checkpointing") is not False:
            callbacks.append(config.get("checkpoint"))
            if config.get("export") == "best":
                from gspo_lightning.run.results import BestCheckpoint

                callbacks.append(BestCheckpoint(dirpath=config.get("checkpoint").dirpath))
        elif config.get("export") == "best":
            raise ConfigError("export: best keeps the best evaluation's weights as a checkpoint: it needs "
                             "trainer.enable_checkpointing (or set --export=last)")
        kwargs["callbacks"] = callbacks
        from gspo_lightning.run.callbacks import attach_run_callbacks

        trainer = super().instantiate_trainer(**kwargs)
        # the run's callbacks: threads, curves, results, stops and failures, records, export
        attach_run_callbacks(trainer, stop_grace_s=config.get("stop_grace_s") or 10.0)
        return trainer

    def _run_subcommand(self, subcommand: str) -> None:
        existing = {Path(d) for d in self._log_dirs()}
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            self._remove_empty_log_dirs(existing)
            raise

    def _log_dirs(self) -> list[str]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return []
        dirs = []
        for logger in trainer.loggers:
            try:
                folder = logger.log_dir
            except Exception:  # noqa: BLE001 - a logger without a local folder
                continue
            if folder and Path(folder).is_dir():
                dirs.append(folder)
        return dirs

    def _remove_empty_log_dirs(self, existing: set[Path]) -> None:
        """A run that failed before its first step leaves no version_N folder behind."""
        if self.trainer.global_step > 0:
            return
        for folder in map(Path, self._log_dirs()):
            if folder in existing:
                continue
            files = [p for p in folder.rglob("*") if p.is_file()]
            if all(p.name.startswith(START_FILES) for p in files):
                shutil.rmtree(folder, ignore_errors=True)
                with contextlib.suppress(OSError):  # the logger's own folder (csv/, tensorboard/), if now empty
                    folder.parent.rmdir()


# ``save_dir`` defaults that mean "the working directory" (W&B's ".", MLflow's "./mlruns"): the
# run folder instead, keeping the last part ("<run folder>/mlruns")
WORKING_DIRECTORY_DEFAULTS = (".", "./", "./mlruns")


def run_folder_loggers(loggers, default_root_dir: Optional[str]) -> None:
    """Loggers with no ``save_dir`` (or the working directory, W&B's and MLflow's defaults) write
    under the run folder, ``trainer.default_root_dir`` (``runs`` when unset), so
    ``--trainer.default_root_dir=DIR`` moves the logs and, with them, the checkpoints (Lightning
    puts them in the first logger's version folder), whatever the loggers."""
    from jsonargparse import Namespace

    from gspo_lightning.run.loggers import DEFAULT_SAVE_DIR

    root = Path(default_root_dir or DEFAULT_SAVE_DIR)
    for entry in loggers if isinstance(loggers, list) else [loggers]:
        args = getattr(entry, "init_args", None)
        if not isinstance(entry, Namespace) or args is None or "save_dir" not in args:
            continue
        save_dir = args.get("save_dir")
        if save_dir is None:
            args["save_dir"] = str(root)
        elif str(save_dir) in WORKING_DIRECTORY_DEFAULTS:
            args["save_dir"] = str(root / Path(str(save_dir)).name) if Path(str(save_dir)).name else str(root)


def tokenizer_source(model_name_or_path: str, gguf_file: Optional[str] = None) -> str:
    """The data module's tokenizer: the model's, a GGUF file named as one path."""
    return model_name_or_path if gguf_file is None else str(Path(model_name_or_path) / gguf_file)


def verifiers_tasks(episodes) -> Optional[dict]:
    """The tasks of ``model.episodes.verifiers`` (``id``, ``args``, ``eval_args``), which the data module reads; or None."""
    if episodes is None:
        return None
    arguments = getattr(episodes, "init_args", episodes)  # a class_path block, or its arguments
    settings = arguments.get("verifiers") if hasattr(arguments, "get") else getattr(arguments, "verifiers", None)
    if settings is None:
        return None
    settings = getattr(settings, "init_args", settings)
    return {key: settings.get(key) if hasattr(settings, "get") else getattr(settings, key)
            for key in ("id", "args", "eval_args")}


def continue_log_versions(loggers, ckpt_path: str) -> None:
    """Point the configured loggers at the version folders the checkpoint's run wrote to, so a
    resumed run continues its metrics.csv, TensorBoard events and curves (unless a version is set)."""
    import torch

    if not loggers or not Path(ckpt_path).is_file():
        return  # Lightning reports a missing checkpoint itself
    # mmap: reads only the small "gspo" entry of what may be a large file
    saved = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True).get("gspo", {}).get("loggers", [])
    from jsonargparse import Namespace
    from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger

    from gspo_lightning._imports import import_object
    from gspo_lightning.run.loggers import CSVLogger as ContinuingCSVLogger

    for entry in loggers if isinstance(loggers, list) else [loggers]:
        args = getattr(entry, "init_args", None)
        if not isinstance(entry, Namespace) or args is None or args.get("version") is not None:
            continue
        cls = import_object(entry.class_path, "logger")  # a re-exported class has another path
        if issubclass(cls, LightningCSVLogger) and not issubclass(cls, ContinuingCSVLogger):
            continue  # Lightning's own CSVLogger deletes the metrics.csv of an existing version
        class_name = f"{cls.__module__}.{cls.__qualname__}"
        for identity in saved:
            same_place = Path(str(args.get("save_dir", ""))).resolve() == Path(identity["save_dir"]).resolve()
            if current_class_path(identity["class"]) == class_name and same_place and args.get("name") == identity["name"]:
                args["version"] = identity["version"]


def current_class_path(class_path: str) -> str:
    """A class path as today's package names it (a checkpoint from before the package was laid
    out by concern names ``gspo_lightning.loggers.CSVLogger``, now ``...run.loggers.CSVLogger``)."""
    from gspo_lightning._imports import moved_target

    module, _, name = class_path.rpartition(".")
    return f"{moved_target(module) or module}.{name}"


# Lightning's messages that say nothing to a GSPO run's user: an advertisement, and the notes
# that our progress bar and summary replaced Lightning's
QUIET_INFO = ("💡 Tip:", "Trainer already configured with model summary callbacks",
              # the run summary names the engine and device; a machine without accelerators says nothing
              "GPU available: False", "TPU available: False", "HPU available: False")


def quiet_lightning_info() -> None:
    import logging

    class Quiet(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith(QUIET_INFO)

    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(type(f).__name__ == "Quiet" for f in logger.filters):  # once per process
            logger.addFilter(Quiet())


# Warnings that say nothing actionable for a GSPO run.
QUIET = [
    ".*Using ModelCheckpoint with manual optimization.*",  # GSPO steps the optimizer itself, by design
    ".*does not have many workers.*",  # prompts are in memory; rollouts dominate a step
    ".*Checkpoint directory .* exists and is not empty.*",  # a resumed run writes into its own folder, by design
    ".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*",
]


def expected_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's to fix: our own types (a setting, data, a reward function, an
    agent, an environment, a learning rate that blows up, a rollout server that is down), a path
    that does not exist, and Lightning's refusal of a value. They print as one message; anything
    else (a ``ValueError`` deep in torch or transformers is a bug to report) keeps its traceback."""
    from gspo_lightning.errors import (AgentError, ConfigError, EpisodeError, MissingPackageError, NonFiniteError,
                                       RolloutServerError)
    from gspo_lightning.rewards.base import RewardError

    from lightning.fabric.utilities.exceptions import MisconfigurationException

    # DataError, ModelSourceError and VLLMStartError are ConfigErrors; FileNotFoundError: a path given
    # on the command line or in the config (a checkpoint, a model folder) that is not there;
    # MisconfigurationException: Lightning's refusal of a value (--trainer.max_steps=-5)
    return (ConfigError, MissingPackageError, RewardError, FileNotFoundError, NonFiniteError, RolloutServerError, AgentError,
            EpisodeError, MisconfigurationException)


def main(args: Optional[list[str]] = None) -> None:
    import warnings

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from gspo_lightning.data.datamodule import PromptDataModule
    from gspo_lightning.run.preemption import Preempted, Stopped
    from gspo_lightning.run.usage import GSPOArgumentParser, UsageError, short_message
    from gspo_lightning.training.module import GSPOModule

    argv = sys.argv[1:] if args is None else list(args)
    debug = "--debug" in argv or os.environ.get("GSPO_DEBUG", "") not in ("", "0")
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        if args is None:
            sys.argv[1:] = argv  # LightningCLI reads sys.argv itself
    # modules in the working directory import as they do for `python script.py` users
    # (rewards: myrewards.score); appended, so they never shadow installed packages
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())

    for pattern in QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    # transformers' "Loading weights" bar on every run (read when transformers is imported, later)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if next((a for a in argv if not a.startswith("-")), None) in ("validate", "test"):
        # they load a checkpoint's weights only: the callbacks that wrote it have nothing to restore
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint need to be provided.*")
    quiet_lightning_info()
    try:
        GSPOCLI(
            GSPOModule,
            PromptDataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            args=None if args is None else argv,
            auto_configure_optimizers=False,
            parser_class=GSPOArgumentParser,
        )
    except UsageError as err:
        if debug:
            raise
        command = next((a for a in argv if not a.startswith("-")), "fit")
        print(f"gspo: error: {short_message(err, command)}", file=sys.stderr)
        sys.exit(2)
    except Preempted as stop:
        print(f"gspo: {stop}", file=sys.stderr)
    except Stopped:
        pass  # PreemptionCheckpoint said what it wrote, in one line
    except SIGTERMException:
        # PreemptionCheckpoint wrote last.ckpt at the step boundary before Lightning raised this
        print("gspo: stopped by SIGTERM after writing last.ckpt; resume with --ckpt_path <checkpoint dir>/last.ckpt", file=sys.stderr)
    except expected_errors() as err:
        if debug:
            raise
        print(f"gspo: error: {err}\n(for the traceback: rerun with --debug or GSPO_DEBUG=1)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
