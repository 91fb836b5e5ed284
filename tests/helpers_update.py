"""``UpdateSettings`` from the flat keywords tests write (the update loop's blocks built for them)."""

from gspo_lightning.objective.ppo import PPOClip
from gspo_lightning.objective.settings import Objective
from gspo_lightning.training.update import Update, UpdateSettings

OBJECTIVE_FIELDS = ("importance_sampling", "loss_agg_mode", "kl_estimator")
PLAN_FIELDS = ("horizon", "mini_batch_size", "micro_batch_size", "world_size", "no_grad_micro_batch_size")


def update_settings_of(clip_low=3e-4, clip_high=4e-4, dual_clip=None, kl_coef=0.0, **keys) -> UpdateSettings:
    """The settings of one rollout's updates: PPO's clip, ``kl_coef`` as the KL loss (0: none), the
    objective's and the loop's other fields by name, and the batch plan (``mini_batch_size``...)."""
    objective = Objective(policy_loss=PPOClip(clip_low, clip_high, dual_clip), use_kl_loss=kl_coef != 0, kl_loss_coef=kl_coef,
                          **{k: keys.pop(k) for k in OBJECTIVE_FIELDS if k in keys})
    plan = {k: keys.pop(k) for k in PLAN_FIELDS if k in keys}
    return UpdateSettings(Update(**{k: v for k, v in keys.items() if k != "mini_batch_size"}), objective, **plan)
