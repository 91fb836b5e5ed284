"""The objective: pure tensor functions, no Lightning, no model. Losses (GSPO, GSPO-token, GRPO;
per unit the PPO clip, SAPO, CISPO or GMPO), advantages, off-policy correction, the clip budget,
the options they accept, pass@k."""

from gspo_lightning._imports import lazy_exports

EXPORTS = {
    **dict.fromkeys(["policy_loss", "kl_penalty", "aggregate_loss", "log_importance_ratio", "masked_sequence_mean"], "loss"),
    **dict.fromkeys(["compute_advantages", "rewards_to_advantages", "normalize_rewards", "whiten", "RunningMoments"], "advantages"),
    **dict.fromkeys(["OffPolicyCorrection", "importance_weights", "log_weights", "bound_weights", "check_correction"], "offpolicy"),
    **dict.fromkeys(["ClipBudget", "attribute_clips", "clip_budget_metrics", "split_log_ratio"], "clip_budget"),
    **dict.fromkeys(["check_choice", "choices", "clip_range", "validate_gspo_settings", "DEFAULT_CLIP"], "options"),
    **dict.fromkeys(["pass_at_k", "pass_at_k_from_scores"], "passk"),
}
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
