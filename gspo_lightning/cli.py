"""The ``gspo`` command, as thin as it can be: it reads the subcommand, then imports only what
that subcommand needs.

- ``gspo fit | validate | test --config cfg.yaml [--model.key=value ...]``: training,
  evaluation (``run/command.py``, a LightningCLI: imports torch, Lightning, transformers);
- ``gspo serve --config cfg.yaml [--host H --port P]``: a rollout server
  (``run/serve.py``: parses its arguments before it imports torch);
- ``gspo export-model --model NAME --out DIR``: a model as a folder transformers and
  ``vllm serve`` load (``run/export.py``);
- ``gspo``, ``gspo --help``, ``gspo --version``: answered here, with nothing imported.
"""

from __future__ import annotations

import sys
from typing import Optional

from gspo_lightning import __version__
from gspo_lightning.run.cpu_env import configure_cpu_env

TRAINING_COMMANDS = ("fit", "validate", "test")

USAGE = f"""usage: gspo {{fit,validate,test,serve,export-model}} [options]

GSPO (Group Sequence Policy Optimization) for language models, on Lightning ({__version__}).

commands:
  fit        train: gspo fit --config configs/quickstart.yaml [--model.clip_high=4e-4 ...]
  validate   held-out evaluation (pass@k) of a model or a checkpoint (--ckpt_path)
  test       evaluation on the test split
  serve      a rollout server for gspo fit: gspo serve --config cfg.yaml [--host H --port P]
  export-model  a model as a folder transformers and vllm serve load:
             gspo export-model --model builtin:tiny-successor --out DIR (or --checkpoint last.ckpt)

options:
  -h, --help  this message; `gspo fit --help`: the keys most runs change, by concern;
              `gspo fit --help-all`: every config key
  --version   the version

docs/quickstart.md and docs/config.md in the repository say more."""


def main(args: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    command = argv[0] if argv else None
    if command in (None, "-h", "--help"):
        print(USAGE)
        if command is None:
            sys.exit(2)  # a command is required, as before
        return
    if command == "--version":
        print(f"gspo-lightning {__version__}")
        return
    configure_cpu_env(command)  # before anything imports torch: OpenMP reads its settings once, at load
    if command == "serve":
        from gspo_lightning.run.serve import main as serve

        serve(argv[1:])
        return
    if command == "export-model":
        from gspo_lightning.run.export import main as export_model

        export_model(argv[1:])
        return
    if command == "fit" and any(a in ("-h", "--help") for a in argv[1:]):
        from gspo_lightning.run.help import FIT_HELP  # text only: no torch, no Lightning

        print(FIT_HELP)
        return
    if command in TRAINING_COMMANDS and "--help-all" in argv:
        full = ["--help" if a == "--help-all" else a for a in argv]  # jsonargparse's full help
        if args is None:
            sys.argv[1:] = full  # LightningCLI reads sys.argv itself
        else:
            args = full
    from gspo_lightning.run.command import main as train  # LightningCLI: it reports unknown commands itself

    train(args)


if __name__ == "__main__":
    main()
