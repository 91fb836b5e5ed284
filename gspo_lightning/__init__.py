"""gspo-lightning: Group Sequence Policy Optimization for language models, on Lightning."""

__version__ = "0.1.0"

from gspo_lightning.loss import kl_penalty, policy_loss  # noqa: E402

__all__ = ["__version__", "kl_penalty", "policy_loss"]
