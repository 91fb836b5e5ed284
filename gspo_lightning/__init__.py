"""gspo-lightning: Group Sequence Policy Optimization for language models, on Lightning."""

__version__ = "0.1.0"

__all__ = ["__version__", "kl_penalty", "policy_loss"]


def __getattr__(name: str):
    # lazy: the `gspo` command sets OpenMP's environment (cpu_env.py) before torch loads
    if name in ("kl_penalty", "policy_loss"):
        from gspo_lightning import loss

        return getattr(loss, name)
    raise AttributeError(f"module 'gspo_lightning' has no attribute {name!r}")
