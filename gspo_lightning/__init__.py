"""gspo-lightning: Group Sequence Policy Optimization for language models, on Lightning.

The package by concern (docs/architecture.md has the map):

- ``objective/``: pure tensor functions: losses, advantages, off-policy correction, clip budget, pass@k
- ``training/``: the LightningModule, the update loop and what it calls (strategy ops, log-probs, metrics)
- ``models/``: loading policies and tokenizers (hub id, folder, GGUF, builtin), MoE routing
- ``data/``: the DataModule, built-in tasks and datasets
- ``rollout/``: engines, weight transports, the rollout server, the asynchronous pipeline
- ``rewards/``: reward functions in TRL's convention
- ``episodes/``: multi-turn episodes' parts: tools, tool-call parsers, environments, the chat renderer
- ``run/``: the run around training: the command, loggers, progress, plots, preemption, export
"""

from gspo_lightning._imports import lazy_exports

__version__ = "0.1.0"

# lazy: `gspo serve` sets OpenMP's environment (run/cpu_env.py) before torch loads
__getattr__, __dir__ = lazy_exports(__name__, {"kl_penalty": "objective.loss", "policy_loss": "objective.loss"})

__all__ = ["__version__", "kl_penalty", "policy_loss"]
