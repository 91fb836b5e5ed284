"""Generation engines, how weights reach them, and the worker that produces rollouts."""

from gspo_lightning.rollout.engine import EngineSpec, Generation, RolloutEngine, SamplingParams
from gspo_lightning.rollout.hf import HFEngine
from gspo_lightning.rollout.hf_copy import HFCopyEngine
from gspo_lightning.rollout.remote import RemoteEngine
from gspo_lightning.rollout.vllm import VLLMEngine
from gspo_lightning.rollout.worker import Rollout, RolloutWorker

__all__ = ["EngineSpec", "Generation", "HFCopyEngine", "HFEngine", "RemoteEngine", "Rollout", "RolloutEngine", "RolloutWorker", "SamplingParams", "VLLMEngine"]
