"""The objective: pure tensor functions, no Lightning, no model. Losses (GSPO, GSPO-token, GRPO;
per unit one class each: ``PPOClip``, ``SAPO``, ``CISPO``, ``GMPO``, or your own ``PolicyObjective``),
advantages, off-policy correction, the clip budget, the options they accept, pass@k, and the
config blocks they read (``Objective``, ``Advantages``, ``Evaluation``)."""

from gspo_lightning._imports import lazy_exports

EXPORTS = {
    **dict.fromkeys(["policy_loss", "kl_penalty", "aggregate_loss", "log_importance_ratio", "masked_sequence_mean",
                     "make_objective", "OBJECTIVES"], "loss"),
    **dict.fromkeys(["PolicyObjective", "Units"], "policy"),
    "PPOClip": "ppo", "SAPO": "sapo", "CISPO": "cispo", "GMPO": "gmpo", "DEFAULT_CLIP": "ppo",
    "Objective": "settings",
    **dict.fromkeys(["compute_advantages", "rewards_to_advantages", "normalize_rewards", "whiten", "RunningMoments",
                     "Advantages"], "advantages"),
    **dict.fromkeys(["OffPolicyCorrection", "importance_weights", "log_weights", "bound_weights", "check_correction"], "offpolicy"),
    **dict.fromkeys(["ClipBudget", "attribute_clips", "clip_budget_metrics", "split_log_ratio"], "clip_budget"),
    **dict.fromkeys(["check_choice", "choices"], "options"),
    **dict.fromkeys(["pass_at_k", "pass_at_k_from_scores", "Evaluation"], "passk"),
}
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
