"""Generation engines and the callback that produces fresh rollouts every step."""

from gspo_lightning.rollout.callback import Rollout, RolloutCallback, build_rollout
from gspo_lightning.rollout.engine import Generation, RolloutEngine, SamplingParams
from gspo_lightning.rollout.hf import HFEngine

__all__ = ["Generation", "HFEngine", "Rollout", "RolloutCallback", "RolloutEngine", "SamplingParams", "build_rollout"]
