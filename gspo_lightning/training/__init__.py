"""The training loop: the LightningModule (one step: rollout, old and reference log-probs,
advantages, updates), the updater and the optimizer calls it makes through a Lightning
strategy, loss scaling, sums over ranks, FSDP2 sharding, row filters, log-probs, step metrics."""

from gspo_lightning._imports import lazy_exports

EXPORTS = {
    "GSPOModule": "module",
    **dict.fromkeys(["PolicyUpdater", "UpdateOps", "UpdateSettings", "MicroBatch", "MetricHook", "update_settings"], "update"),
    "StrategyOps": "strategy_ops",
    "LossScaling": "loss_scaling",
    **dict.fromkeys(["GradientSync", "all_reduce_sum", "all_ranks_true", "clip_grad_norm"], "distributed"),
    "fully_shard_causal_lm": "sharding",
    **dict.fromkeys(["loss_mask", "micro_batches", "rows_with_advantage"], "row_filters"),
    **dict.fromkeys(["response_logprobs", "token_logprobs"], "logprobs"),
    **dict.fromkeys(["StepMetrics", "record_rollout"], "metrics"),
    **dict.fromkeys(["drop_frozen_weights", "restore_frozen_weights", "run_state"], "checkpointing"),
}
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
