"""Every choice a config can make, defined once, and the checks of the GSPO settings.

The ``Literal`` types below are used in signatures (so the CLI rejects a bad value and
``--help`` lists the good ones) and by :func:`check_choice` in the pure functions, so a
new value is added in one place.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional, get_args

ImportanceSampling = Literal["seq", "seq-token", "token"]
# the per-unit objective (objective/loss.py): PPO's clipped surrogate, SAPO's soft gate, CISPO's
# clipped stop-gradient weight, GMPO's geometric mean of log-clipped token ratios
PolicyLossType = Literal["ppo", "sapo", "cispo", "gmpo"]
LossAggMode = Literal[
    "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-sum-token-sum-norm", "token-mean",
]
KLEstimator = Literal["k1", "k2", "k3"]
AdvEstimator = Literal["grpo", "reinforce", "rloo", "dr_grpo"]
RewardNorm = Literal["group", "batch", "running"]
OldLogprobs = Literal["recompute", "engine"]
OnRewardError = Literal["raise", "zero"]
Dtype = Literal["float32", "bfloat16", "float16"]

# estimators that compare the responses of one prompt (they need G >= 2)
GROUP_ESTIMATORS = ("grpo", "rloo", "dr_grpo")

# Clip ranges follow the level of the ratio they clip (GSPO paper, section 5.1 / ROLL).
DEFAULT_CLIP = {"seq": (3e-4, 4e-4), "seq-token": (3e-4, 4e-4), "token": (0.2, 0.27)}
# Objectives whose clip is not PPO's trust region have their own defaults, the same at every level.
# CISPO bounds a stop-gradient weight: no lower bound (MiniMax-M1 set clip_low large), the ratio
# capped at 5 (ScaleRL's epsilon_max = 5, TRL's recommended epsilon_high). GMPO clips token
# log-ratios to [-0.4, 0.4] (its paper and verl's example).
DEFAULT_CLIP_BY_LOSS = {"cispo": (1.0, 4.0), "gmpo": (0.4, 0.4)}
# SAPO's gate temperatures for positive / negative advantages (the paper's, also TRL's and verl's)
DEFAULT_SAPO_TAU = (1.0, 1.05)


def choices(option: Any) -> tuple:
    """The values of a ``Literal`` option type."""
    return get_args(option)


def check_choice(name: str, value: Any, option: Any, *, allow_none: bool = False) -> None:
    """Raise a ``ValueError`` naming ``name`` and the valid values when ``value`` is not one."""
    if value is None and allow_none:
        return
    if value not in get_args(option):
        valid = ", ".join(repr(v) for v in get_args(option)) + (", None" if allow_none else "")
        raise ValueError(f"{name} must be one of {valid}; got {value!r}")


def validate_gspo_settings(s: dict[str, Any]) -> None:
    """All problems of a ``GSPOModule`` configuration at once, before any model loads."""
    problems = []
    G = s["num_return_sequences_in_group"]
    for name, option, allow_none in (
        ("importance_sampling", ImportanceSampling, False), ("loss_agg_mode", LossAggMode, False),
        ("policy_loss_type", PolicyLossType, False),
        ("kl_estimator", KLEstimator, False), ("adv_estimator", AdvEstimator, False),
        ("reward_norm", RewardNorm, True), ("old_logprobs", OldLogprobs, False),
        ("on_reward_error", OnRewardError, False), ("dtype", Dtype, False),
    ):
        try:
            check_choice(name, s[name], option, allow_none=allow_none)
        except ValueError as err:
            problems.append(str(err))
    if G < 1:
        problems.append(f"num_return_sequences_in_group must be >= 1, got {G}")
    if s["adv_estimator"] in GROUP_ESTIMATORS and G < 2:
        problems.append(f"adv_estimator={s['adv_estimator']} compares responses of a prompt: set num_return_sequences_in_group >= 2 (or use reinforce)")
    if s["reward_norm"] == "group" and G < 2:
        problems.append("reward_norm=group needs num_return_sequences_in_group >= 2")
    for name in ("clip_low", "clip_high", "reward_clip", "advantage_clip", "kl_loss_coef", "kl_coef", "router_aux_loss_coef"):
        if s[name] is not None and s[name] < 0:
            problems.append(f"{name} must be >= 0, got {s[name]}")
    loss_type = s.get("policy_loss_type", "ppo")
    if loss_type == "ppo" and s["clip_low"] is not None and s["clip_low"] >= 1:
        problems.append(f"clip_low must be < 1 (the ratio is clipped at 1 - clip_low), got {s['clip_low']}")
    problems += _objective_problems(s)
    if s["dual_clip_loss"] and s["dual_clip"] <= 1:
        problems.append(f"dual_clip must be > 1 (3 is usual), got {s['dual_clip']}")
    if (s["reward_shift"] or s["reward_scale"]) and s["reward_norm"] is None:
        problems.append("reward_shift / reward_scale act only with a reward_norm: set reward_norm (group, batch or running) or turn them off")
    if s.get("max_sampling_rounds", 0) < 0:
        problems.append(f"max_sampling_rounds must be >= 0 (extra generation rounds per step), got {s['max_sampling_rounds']}")
    if s.get("dynamic_sampling") and G < 2:
        problems.append("dynamic_sampling keeps groups whose rewards differ: set num_return_sequences_in_group >= 2")
    if s.get("dynamic_sampling") and s["adv_estimator"] not in GROUP_ESTIMATORS:
        # its filler groups (all rewards equal) get advantage 0 only from an estimator that compares within a group
        problems.append(f"dynamic_sampling with adv_estimator={s['adv_estimator']}: the zero-variance groups that fill a step "
                        f"would train with non-zero advantages (reward minus a batch baseline); use a group estimator "
                        f"({', '.join(GROUP_ESTIMATORS)}) or turn dynamic_sampling off")
    if s["reward_shift"] and s["reward_scale"]:
        problems.append("reward_shift and reward_scale are exclusive (set neither to both shift and scale)")
    if s["routing_replay"] and s["old_logprobs"] == "engine":
        problems.append("routing_replay records routing in the trainer's old-policy pass: set old_logprobs=recompute")
    if s["add_token_level_kl"] and s["kl_coef"] == 0:
        problems.append("add_token_level_kl needs kl_coef > 0")
    if s["ppo_epochs"] < 1:
        problems.append(f"ppo_epochs must be >= 1, got {s['ppo_epochs']}")
    for name in ("num_mini_batches", "mini_batch_size", "micro_batch_size", "logprob_chunk_size"):
        if s[name] is not None and s[name] < 1:
            problems.append(f"{name} must be >= 1 or null, got {s[name]}")
    if s["mini_batch_size"] and s["micro_batch_size"] and s["mini_batch_size"] % s["micro_batch_size"]:
        problems.append(f"mini_batch_size={s['mini_batch_size']} is not a multiple of micro_batch_size={s['micro_batch_size']}")
    if s["response_length"] < 1:
        problems.append(f"response_length must be >= 1, got {s['response_length']}")
    if s["val_num_samples"] < 1:
        problems.append(f"val_num_samples must be >= 1, got {s['val_num_samples']}")
    if s["temperature"] <= 0:
        problems.append(f"temperature must be > 0 for training rollouts, got {s['temperature']}")
    if not 0 < s["top_p"] <= 1:
        problems.append(f"top_p must be in (0, 1], got {s['top_p']}")
    if s["top_k"] < 0:
        problems.append(f"top_k must be >= 0 (0: off), got {s['top_k']}")
    if s.get("dynamic_sampling") and s.get("max_staleness", 0) > 0:
        problems.append("dynamic_sampling decides a step's extra rounds after seeing its rewards, which a rollout made "
                        "ahead (max_staleness > 0) cannot: turn one of them off")
    if s.get("max_staleness", 0) < 0:
        problems.append(f"max_staleness must be >= 0 (0: synchronous), got {s['max_staleness']}")
    if s.get("stale_rollouts", "regenerate") not in ("regenerate", "reweight"):
        problems.append(f"stale_rollouts must be 'regenerate' or 'reweight', got {s['stale_rollouts']!r}")
    if s.get("stale_rollouts") == "reweight" and s.get("max_staleness", 0) > 0 and not s.get("off_policy"):
        problems.append("stale_rollouts=reweight keeps too-stale rollouts for the importance correction, and off_policy is "
                        "not set: set off_policy (e.g. {mode: decoupled}) or stale_rollouts=regenerate")
    if s.get("off_policy"):
        from gspo_lightning.objective.offpolicy import OffPolicyCorrection, check_correction

        problems += check_correction(OffPolicyCorrection(**s["off_policy"]), old_logprobs=s["old_logprobs"],
                                     importance_sampling=s["importance_sampling"])
    if problems:
        raise ValueError("invalid GSPO configuration:\n  - " + "\n  - ".join(problems))
    _warn_surprises(s)


def _objective_problems(s: dict[str, Any]) -> list[str]:
    """The combinations of ``policy_loss_type`` with other keys that cannot act as written."""
    loss_type, problems = s.get("policy_loss_type", "ppo"), []
    taus = {name: s.get(name) for name in ("sapo_tau_pos", "sapo_tau_neg")}
    if loss_type != "sapo":
        problems += [f"{name} is SAPO's gate temperature: set policy_loss_type=sapo or unset {name}"
                     for name, value in taus.items() if value is not None]
    else:
        problems += [f"{name} must be > 0 (the gate's slope; the paper: 1.0 / 1.05), got {value}"
                     for name, value in taus.items() if value is not None and not value > 0]
        problems += [f"{name} sets a clip range, and sapo has none (its gate's sapo_tau_pos / sapo_tau_neg set how fast "
                     f"off-policy updates fade): unset {name}" for name in ("clip_low", "clip_high") if s[name] is not None]
    if loss_type != "ppo" and s["dual_clip_loss"]:
        problems.append(f"dual_clip_loss bounds PPO's clipped surrogate; policy_loss_type={loss_type} has none: "
                        f"set dual_clip_loss: false or policy_loss_type=ppo")
    if loss_type == "gmpo" and s["importance_sampling"] != "seq":
        problems.append(f"gmpo's ratio is the geometric mean of the (clipped) token ratios, a sequence ratio: set "
                        f"importance_sampling: seq (got {s['importance_sampling']})")
    if loss_type == "gmpo" and s["add_token_level_kl"]:
        problems.append("gmpo weighs each response by one advantage, and add_token_level_kl makes advantages differ "
                        "per token: turn add_token_level_kl off (use_kl_loss adds a KL term) or use another policy_loss_type")
    return problems


def _warn_surprises(s: dict[str, Any]) -> None:
    """Legal settings that rarely mean what their author wanted."""
    loss_type = s.get("policy_loss_type", "ppo")
    if loss_type == "sapo" and s["importance_sampling"] != "token":
        tau = min(v if v is not None else d for v, d in zip((s.get("sapo_tau_pos"), s.get("sapo_tau_neg")), DEFAULT_SAPO_TAU))
        if tau < 100:
            warnings.warn(
                f"sapo at importance_sampling={s['importance_sampling']} with a gate temperature of {tau:g}: sequence "
                f"ratios usually stay within ~1e-3 of 1 (GSPO clips at 3e-4 / 4e-4), where the gate passes nearly all of "
                f"the gradient (its weight 4 g (1 - g) is 1/2 only at |tau (s - 1)| = 1.76): sequence-level policy "
                f"gradient without a trust region. A gate acting where GSPO's clip does needs tau of several thousand "
                f"(docs/algorithm.md)",
                stacklevel=4,
            )
    if s["importance_sampling"] != "token" and loss_type == "ppo":
        for name in ("clip_low", "clip_high"):
            if s[name] is not None and s[name] >= 0.1:
                warnings.warn(
                    f"{name}={s[name]} with importance_sampling={s['importance_sampling']}: sequence-level ratios "
                    f"stay within ~1e-3 of 1, so a token-sized clip range almost never clips (the paper uses 3e-4 / 4e-4)",
                    stacklevel=4,
                )
    if s.get("max_staleness", 0) > 0 and not s.get("off_policy") and s["old_logprobs"] == "recompute":
        warnings.warn(f"max_staleness={s['max_staleness']} with old_logprobs=recompute and no off_policy correction: "
                      f"rollouts up to {s['max_staleness']} step(s) old are trained as if the current policy had "
                      f"sampled them (nothing weighs the staleness); set off_policy: {{mode: decoupled}} (or "
                      f"old_logprobs=engine, whose ratio then sees the staleness)", stacklevel=4)
    if s["reward_norm"] in ("group", "batch") and (s["reward_shift"] or s["reward_scale"]):
        which = "reward_shift" if s["reward_shift"] else "reward_scale"
        warnings.warn(f"{which} with reward_norm={s['reward_norm']}: here it means {'subtract the mean only' if s['reward_shift'] else 'divide by the std only'}; "
                      f"ROLL honours {which} only with reward_norm=running and ignores it otherwise", stacklevel=4)


def clip_range(importance_sampling: str, clip_low: Optional[float], clip_high: Optional[float],
               policy_loss_type: str = "ppo") -> tuple[float, float]:
    """``(clip_low, clip_high)`` with the defaults filled in: those of the ratio level for ``ppo``
    (and ``sapo``, which clips nothing), the objective's own for ``cispo`` and ``gmpo``."""
    default_low, default_high = DEFAULT_CLIP_BY_LOSS.get(policy_loss_type, DEFAULT_CLIP[importance_sampling])
    return (default_low if clip_low is None else clip_low, default_high if clip_high is None else clip_high)


__all__ = [
    "AdvEstimator", "DEFAULT_CLIP", "DEFAULT_CLIP_BY_LOSS", "DEFAULT_SAPO_TAU", "Dtype", "GROUP_ESTIMATORS", "ImportanceSampling", "KLEstimator", "LossAggMode",
    "OldLogprobs", "OnRewardError", "PolicyLossType", "RewardNorm", "check_choice", "choices", "clip_range", "validate_gspo_settings",
]
