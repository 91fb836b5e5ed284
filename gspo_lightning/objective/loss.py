"""The GSPO policy loss by name: ``policy_loss(..., policy_loss_type=...)`` and the objectives it knows.

Each per-unit objective is one class in its own file (``ppo.py``: PPO's clip with the dual clip,
``sapo.py``, ``cispo.py``, ``gmpo.py``; the shared base and loss pipeline in ``policy.py``, the
ratio, KL and aggregation terms in ``terms.py``). This module finds them by name, builds one
from a checkpoint's ``{class_path, init_args}``, and keeps the keyword function of earlier
releases, whose arguments name every knob at once (docs/algorithm.md).
"""

from __future__ import annotations

from typing import Any, Optional, Union

from torch import Tensor

from gspo_lightning._imports import import_object
from gspo_lightning.errors import ConfigError
from gspo_lightning.objective.cispo import CISPO
from gspo_lightning.objective.gmpo import GMPO
from gspo_lightning.objective.options import ImportanceSampling, KLEstimator, LossAggMode, check_choice, choices
from gspo_lightning.objective.policy import PolicyObjective, plain_class
from gspo_lightning.objective.ppo import PPOClip
from gspo_lightning.objective.sapo import SAPO, SATURATED_WEIGHT
from gspo_lightning.objective.terms import (
    MAX_KL_VALUE, MAX_LOG_RATIO, Count, aggregate_loss, kl_penalty, log_importance_ratio, masked_sequence_mean,
)

# the built-in objectives by name; a user's own is chosen by class_path and needs no entry here
OBJECTIVES: dict[str, type[PolicyObjective]] = {cls.name: cls for cls in (PPOClip, SAPO, CISPO, GMPO)}
POLICY_LOSS_TYPES = tuple(OBJECTIVES)
IMPORTANCE_SAMPLING_LEVELS = choices(ImportanceSampling)
LOSS_AGG_MODES = choices(LossAggMode)
KL_ESTIMATORS = choices(KLEstimator)
SAPO_SATURATED_WEIGHT = SATURATED_WEIGHT


def make_objective(spec: Union[str, dict, PolicyObjective, None]) -> PolicyObjective:
    """An objective from a name (``"ppo"``, ``"sapo"``, ``"cispo"``, ``"gmpo"``), a
    ``{class_path, init_args}`` mapping (a checkpoint's, or a user's own class) or an instance."""
    if spec is None:
        return PPOClip()
    if isinstance(spec, PolicyObjective):  # a parser's lazy instance becomes a plain one
        cls = plain_class(spec)
        return spec if type(spec) is cls else cls(**spec.settings())
    if isinstance(spec, str):
        if spec not in OBJECTIVES:
            raise ConfigError(f"policy objective {spec!r} is not one of {', '.join(map(repr, OBJECTIVES))}; "
                             f"your own: {{class_path: package.module.Class, init_args: {{...}}}}")
        return OBJECTIVES[spec]()
    if isinstance(spec, dict) and "class_path" in spec:
        cls = import_object(spec["class_path"], "policy objective")
        if not (isinstance(cls, type) and issubclass(cls, PolicyObjective)):
            raise ConfigError(f"policy objective {spec['class_path']!r} is not a subclass of "
                             f"gspo_lightning.objective.PolicyObjective")
        return cls(**(spec.get("init_args") or {}))
    raise ConfigError(f"a policy objective is a name, a {{class_path, init_args}} mapping or a PolicyObjective; got {spec!r}")


def objective_spec(objective: PolicyObjective) -> dict[str, Any]:
    """``{class_path, init_args}``: plain values, as checkpoints hold them."""
    cls = plain_class(objective)
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": objective.settings()}


def objective_from_keywords(policy_loss_type: str, keywords: dict[str, Any], *, strict: bool = False) -> PolicyObjective:
    """The objective named ``policy_loss_type`` from the flat keywords of earlier releases
    (``clip_low``, ``dual_clip``, ``sapo_tau_pos``...): each class takes those it has (``LEGACY_KEYS``).
    ``strict``: a keyword it does not have, set to a value, is an error (a config's); else ignored."""
    if policy_loss_type not in OBJECTIVES:
        raise ConfigError(f"policy_loss_type must be one of {', '.join(map(repr, OBJECTIVES))}; got {policy_loss_type!r}")
    cls = OBJECTIVES[policy_loss_type]
    unknown = [key for key, value in keywords.items() if value is not None and key not in cls.LEGACY_KEYS]
    if strict and unknown:
        raise ConfigError(f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a setting of the "
                         f"{policy_loss_type} objective (its keys: {', '.join(cls.LEGACY_KEYS) or 'none'}): unset "
                         f"{' and '.join(unknown)} or choose another policy_loss_type")
    return cls(**{cls.LEGACY_KEYS[key]: value for key, value in keywords.items()
                  if key in cls.LEGACY_KEYS and (value is not None or not strict)})


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    importance_sampling: str = "seq",
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: Optional[float] = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    ref_logprobs: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    num_seqs: Count = None,
    num_tokens: Count = None,
    horizon: Optional[int] = None,
    is_weights: Optional[Tensor] = None,
    policy_loss_type: str = "ppo",
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss (to minimize) and its diagnostics.

    Per unit (a token, or a response at the sequence levels, whose ratio ``w`` is on each of its
    tokens), by ``policy_loss_type`` (``docs/algorithm.md``; each is a class, :data:`OBJECTIVES`):

    - ``ppo``: ``-min(w A, clip(w, 1 - clip_low, 1 + clip_high) A)``, with the objective raised
      to ``dual_clip * A`` where ``A < 0`` if ``dual_clip`` is set;
    - ``sapo``: ``-f(w) A`` with ``f(w) = sigmoid(tau (w - 1)) * 4 / tau``, ``tau = sapo_tau_pos``
      where ``A > 0`` else ``sapo_tau_neg``: a soft gate in place of the clip;
    - ``cispo``: ``-sg(clip(w, max(0, 1 - clip_low), 1 + clip_high)) A lp``: the clipped weight
      carries no gradient, so the clip bounds each token's weight and zeroes none;
    - ``gmpo`` (``importance_sampling="seq"`` only): ``-A_i exp((1/L_i) sum_t d'_t)``, each
      token log-ratio ``d_t`` clipped to ``[-clip_low, clip_high]`` on the side the sign of the
      sequence advantage ``A_i`` (the mean of its tokens' advantages) makes binding.

    Each token's loss, plus ``kl_coef * KL``, is aggregated by ``loss_agg_mode``.

    Args:
        logprobs: ``(B, T)`` log-probs of the sampled tokens under the current policy.
        old_logprobs: ``(B, T)`` the same under the policy that generated the samples.
        advantages: ``(B,)`` one per response, or ``(B, T)`` one per token.
        mask: ``(B, T)`` 1 for real response tokens, 0 for padding.
        importance_sampling: ``"token"`` (GRPO/PPO), ``"seq"`` (GSPO) or ``"seq-token"`` (GSPO-token).
        clip_low, clip_high: clip range ``[1 - clip_low, 1 + clip_high]``. Sequence ratios
            need ranges of about 1e-4 (the paper: 3e-4 / 4e-4), token ratios about 0.2 (sapo: unused).
        dual_clip: ``c > 1`` bounds the loss of negative-advantage samples by ``c * |A|`` (ppo only).
        ref_logprobs, kl_coef, kl_estimator: the KL-to-reference term, when ``kl_coef > 0``.
        num_seqs, num_tokens, horizon: global denominators, see :func:`aggregate_loss`.
        is_weights: ``(B,)`` or ``(B, T)`` off-policy importance weights (``objective/offpolicy.py``,
            no gradient) multiplying each token's surrogate (not the KL term); ``None``: 1.
        policy_loss_type: ``"ppo"`` (default), ``"sapo"``, ``"cispo"`` or ``"gmpo"``, see above.
        sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures (> 0; the paper: 1.0 and 1.05).

    Returns:
        ``(loss, metrics)`` where metrics are detached scalars of this batch: the ratio's
        mean/min/max, ``kl`` when a reference is given, and the objective's own: clip fractions
        (low/high/total; ``dual_clip_frac`` for ppo) for ppo, cispo and gmpo, the gate's
        ``gate_weight_mean`` and ``gate_saturated_frac`` (low/high/total) for sapo. At the
        sequence levels they count sequences (a sequence's share of flagged tokens, for gmpo).
    """
    check_choice("kl_estimator", kl_estimator, KLEstimator)
    objective = objective_from_keywords(policy_loss_type, dict(
        clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, sapo_tau_pos=sapo_tau_pos, sapo_tau_neg=sapo_tau_neg))
    if dual_clip is not None and "dual_clip" not in type(objective).LEGACY_KEYS:
        raise ConfigError(f"dual_clip bounds PPO's clipped surrogate; policy_loss_type={policy_loss_type!r} has none: pass dual_clip=None")
    check_choice("importance_sampling", importance_sampling, ImportanceSampling)
    level_problem = objective.level_problem(importance_sampling)
    if level_problem:
        raise ConfigError(level_problem)
    return objective.resolved(importance_sampling).loss(
        logprobs, old_logprobs, advantages, mask, importance_sampling=importance_sampling, loss_agg_mode=loss_agg_mode,
        ref_logprobs=ref_logprobs, kl_coef=kl_coef, kl_estimator=kl_estimator, num_seqs=num_seqs, num_tokens=num_tokens,
        horizon=horizon, is_weights=is_weights,
    )


__all__ = [
    "CISPO", "Count", "GMPO", "IMPORTANCE_SAMPLING_LEVELS", "KL_ESTIMATORS", "LOSS_AGG_MODES", "MAX_KL_VALUE", "MAX_LOG_RATIO",
    "OBJECTIVES", "POLICY_LOSS_TYPES", "PPOClip", "PolicyObjective", "SAPO", "aggregate_loss", "kl_penalty",
    "log_importance_ratio", "make_objective", "masked_sequence_mean", "objective_from_keywords", "objective_spec", "policy_loss",
]
