"""Reward functions ``fn(prompts=, completions=, completion_ids=, **columns) -> list[float | None]``
(TRL's convention) and how they combine."""

from gspo_lightning.rewards.base import RewardComposer, RewardError, RewardSpec, RewardUnavailable, import_function
from gspo_lightning.rewards.judge import LLMJudge
from gspo_lightning.rewards.math import exact_match, math_accuracy
from gspo_lightning.rewards.reward_model import RewardModel
from gspo_lightning.rewards.shaping import format_reward, length_penalty

__all__ = [
    "LLMJudge", "RewardComposer", "RewardError", "RewardModel", "RewardSpec", "RewardUnavailable", "exact_match",
    "format_reward", "import_function", "length_penalty", "math_accuracy",
]
