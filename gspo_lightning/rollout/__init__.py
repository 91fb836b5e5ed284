"""Rollouts: generation engines (chosen by ``class_path``), how weights reach them, the worker
that samples and scores, where a step's rollout comes from (now, or generated ahead on a
producer thread), dynamic sampling, and the rollout server with its client engine."""

from gspo_lightning._imports import lazy_exports

EXPORTS = {
    **dict.fromkeys(["EngineSpec", "Generation", "RolloutEngine", "SamplingParams"], "engine"),
    "HFEngine": "hf",
    **dict.fromkeys(["PHASES", "Phase", "PhaseTracker"], "phases"),
    "HFCopyEngine": "hf_copy",
    "RemoteEngine": "remote",
    "StockVLLMEngine": "stock_vllm",
    "VLLMEngine": "vllm",
    **dict.fromkeys(["Rollout", "RolloutWorker"], "worker"),
    "run_episodes": "episodes",
    **dict.fromkeys(["WeightTransport", "InProcessTransport", "FolderTransport", "NCCLTransport"], "transport"),
}
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
