"""Every choice a config can make, defined once (each block checks its own values beside its fields).

The ``Literal`` types below are used in signatures (so the CLI rejects a bad value and
``--help`` lists the good ones) and by :func:`check_choice` in the pure functions, so a
new value is added in one place.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from gspo_lightning.errors import ConfigError

ImportanceSampling = Literal["seq", "seq-token", "token"]
LossAggMode = Literal[
    "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-sum-token-sum-norm", "token-mean",
]
KLEstimator = Literal["k1", "k2", "k3"]
AdvEstimator = Literal["grpo", "reinforce", "rloo", "dr_grpo"]
RewardNorm = Literal["group", "batch", "running"]
OldLogprobs = Literal["recompute", "engine"]
OnRewardError = Literal["raise", "zero"]
Dtype = Literal["float32", "bfloat16", "float16"]


def choices(option: Any) -> tuple:
    """The values of a ``Literal`` option type."""
    return get_args(option)


def check_choice(name: str, value: Any, option: Any, *, allow_none: bool = False) -> None:
    """Raise a ``ValueError`` naming ``name`` and the valid values when ``value`` is not one."""
    if value is None and allow_none:
        return
    if value not in get_args(option):
        valid = ", ".join(repr(v) for v in get_args(option)) + (", None" if allow_none else "")
        raise ConfigError(f"{name} must be one of {valid}; got {value!r}")


__all__ = [
    "AdvEstimator", "Dtype", "ImportanceSampling", "KLEstimator", "LossAggMode", "OldLogprobs", "OnRewardError", "RewardNorm",
    "check_choice", "choices",
]
