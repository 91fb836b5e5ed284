"""``GSPOModule``'s config blocks together: the checks that span blocks, and the flat keys of earlier
releases (``model.clip_low``, ROLL's ``model.num_return_sequences_in_group``...) mapped into the blocks.

Each block checks its own fields (``problems()`` beside them); :func:`check_config` adds the checks
between blocks and reports every problem at once, before any model loads. The flat keys keep old
configs, CLI overrides and checkpoints working with the same meaning; :func:`nest_flat_keys` is
the one place that knows them.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

from gspo_lightning.errors import ConfigError
from gspo_lightning.models.settings import Policy
from gspo_lightning.objective.advantages import GROUP_ESTIMATORS, Advantages
from gspo_lightning.objective.loss import objective_from_keywords, objective_spec
from gspo_lightning.objective.passk import Evaluation
from gspo_lightning.objective.settings import Objective
from gspo_lightning.rollout.settings import Asynchronous, RolloutSettings
from gspo_lightning.training.update import Update, plan_batches

BLOCKS: dict[str, type] = {
    "policy": Policy, "rollout": RolloutSettings, "evaluation": Evaluation, "advantages": Advantages,
    "objective": Objective, "update": Update, "asynchronous": Asynchronous,
}
# flat key -> its block (the field keeps its name)
BLOCK_OF: dict[str, str] = {
    field: block for block, cls in BLOCKS.items() for field in cls.__dataclass_fields__ if field != "policy_loss"
}
# flat keys of the per-unit objective: they become objective.policy_loss's class and arguments
OBJECTIVE_KEYS = ("policy_loss_type", "clip_low", "clip_high", "dual_clip_loss", "dual_clip", "sapo_tau_pos", "sapo_tau_neg")
DEFAULT_DUAL_CLIP = 3.0  # what dual_clip_loss: true meant without a dual_clip


def nest_flat_keys(model: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """``model``'s keys with every flat key moved into its block: ``(nested, [(old, new), ...])``.
    Keys already in blocks pass through; an objective key its objective does not have is an error."""
    # blocks copied: the flat keys go into them, not into the caller's dicts
    nested = {key: dict(value) if isinstance(value, dict) else value
              for key, value in model.items() if key not in BLOCK_OF and key not in OBJECTIVE_KEYS}
    renames = []
    for key, value in model.items():
        if key in BLOCK_OF:
            block = nested.setdefault(BLOCK_OF[key], {})
            if not isinstance(block, dict):  # a block given as an object: the flat key would be lost
                raise ConfigError(f"model.{key} and model.{BLOCK_OF[key]} are both set: write {key} inside {BLOCK_OF[key]}")
            block[key] = value
            renames.append((key, f"{BLOCK_OF[key]}.{key}"))
    flat_objective = {key: model[key] for key in OBJECTIVE_KEYS if key in model}
    if flat_objective:
        objective = nested.setdefault("objective", {})
        objective["policy_loss"] = objective_from_flat_keys(flat_objective)
        renames += [(key, objective_spelling(key)) for key in flat_objective]
    return nested, renames


def with_flat_keys(blocks: dict[str, Any], flat_keys: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """``blocks`` (name -> a block, its fields as a dict, or None) with ``flat_keys`` written into
    them: ``(blocks, [(old, new), ...])``. A key that is neither flat nor a block is a ``TypeError``,
    as an unknown keyword argument is."""
    nested, renames = nest_flat_keys(flat_keys)
    unknown = sorted(set(nested) - set(BLOCKS))
    if unknown:
        raise TypeError(f"GSPOModule got unexpected keyword argument(s) {', '.join(unknown)}")
    out = dict(blocks)
    for name, values in nested.items():
        base = out.get(name)
        base = {f.name: getattr(base, f.name) for f in fields(base)} if is_dataclass(base) else dict(base or {})
        out[name] = {**base, **values}
    return out, renames


def objective_from_flat_keys(keys: dict[str, Any]) -> dict[str, Any]:
    """``{class_path, init_args}`` of ``objective.policy_loss`` from ``policy_loss_type``, ``clip_low``,
    ``clip_high``, ``dual_clip_loss`` / ``dual_clip`` and ``sapo_tau_pos`` / ``sapo_tau_neg``."""
    keys = dict(keys)
    name = keys.pop("policy_loss_type", None) or "ppo"
    dual_on, dual = keys.pop("dual_clip_loss", False), keys.pop("dual_clip", None)
    if dual_on:  # the dual clip acted only with dual_clip_loss: true, with dual_clip's value (3 by default)
        keys["dual_clip"] = DEFAULT_DUAL_CLIP if dual is None else dual
    return objective_spec(objective_from_keywords(name, keys, strict=True))


def objective_spelling(flat_key: str) -> str:
    """Where a flat objective key lives now: the class of ``objective.policy_loss``, or one of its arguments."""
    from gspo_lightning.objective.loss import OBJECTIVES

    if flat_key == "policy_loss_type":
        return "objective.policy_loss (its class: PPOClip, SAPO, CISPO or GMPO)"
    argument = {"dual_clip_loss": "dual_clip", **{k: v for cls in OBJECTIVES.values() for k, v in cls.LEGACY_KEYS.items()}}
    return f"objective.policy_loss.init_args.{argument[flat_key]}"


def rename_note(renames: list[tuple[str, str]], where: str = "model") -> str:
    """The one line that names the new spelling of the old keys a config used."""
    moved = ", ".join(f"{where}.{old} -> {where}.{new}" for old, new in renames)
    return f"old flat keys, still read with the same meaning; the new spelling: {moved}"


def check_config(*, policy: Policy, rollout: RolloutSettings, evaluation: Evaluation, advantages: Advantages,
                 objective: Objective, update: Update, asynchronous: Asynchronous) -> None:
    """Every problem of the blocks at once (``ValueError``), then a warning for each legal setting
    that rarely means what its author wanted."""
    problems = (policy.problems() + rollout.problems() + evaluation.problems()
                + advantages.problems(group_size=rollout.num_return_sequences_in_group)
                + objective.problems(add_token_level_kl=advantages.add_token_level_kl) + update.problems()
                + asynchronous.problems(old_logprobs=objective.old_logprobs, importance_sampling=objective.importance_sampling))
    if rollout.dynamic_sampling and not advantages.compares_within_groups:
        # its filler groups (all rewards equal) get advantage 0 only from an estimator that compares within a group
        problems.append(f"dynamic_sampling with adv_estimator={advantages.adv_estimator}: the zero-variance groups that "
                        f"fill a step would train with non-zero advantages (reward minus a batch baseline); use a group "
                        f"estimator ({', '.join(GROUP_ESTIMATORS)}) or turn dynamic_sampling off")
    if rollout.dynamic_sampling and asynchronous.max_staleness > 0:
        problems.append("dynamic_sampling decides a step's extra rounds after seeing its rewards, which a rollout made "
                        "ahead (max_staleness > 0) cannot: turn one of them off")
    if update.routing_replay and objective.old_logprobs == "engine":
        problems.append("routing_replay records routing in the trainer's old-policy pass: set old_logprobs=recompute")
    if rollout.rollout_batch_size is not None and not problems:
        # sizes that cannot divide a step on one rank divide it on no number of ranks: say so now, before
        # a model loads (the ranks' own split is checked when the run knows them)
        try:
            plan_batches(rollout.rollout_batch_size, 1, group_size=rollout.num_return_sequences_in_group,
                         num_mini_batches=update.num_mini_batches, mini_batch_size=update.mini_batch_size,
                         micro_batch_size=update.micro_batch_size, ppo_epochs=update.ppo_epochs)
        except ConfigError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError("invalid GSPO configuration:\n  - " + "\n  - ".join(problems))
    for surprise in (objective.policy_loss.surprises(importance_sampling=objective.importance_sampling)
                     + advantages.surprises() + asynchronous.surprises(old_logprobs=objective.old_logprobs)):
        warnings.warn(surprise, stacklevel=4)


@dataclass
class ModuleSettings:
    """``GSPOModule``'s blocks, read as ``module.settings.<block>.<field>``."""

    policy: Policy
    rollout: RolloutSettings
    evaluation: Evaluation
    advantages: Advantages
    objective: Objective
    update: Update
    asynchronous: Asynchronous

    @classmethod
    def build(cls, **blocks: Any) -> "ModuleSettings":
        """The blocks from what was given (a block, its fields as a dict, or None for its defaults), checked."""
        settings = cls(**{name: _as_block(BLOCKS[name], value) for name, value in blocks.items()})
        check_config(**vars(settings))
        return settings

    def plain_values(self) -> dict[str, dict[str, Any]]:
        """Every block as plain values (the objective as ``{class_path, init_args}``; metric hooks,
        which are functions, left out): what a checkpoint's hyper-parameters hold."""
        values = {name: {f.name: getattr(block, f.name) for f in fields(block)} for name, block in vars(self).items()}
        values["objective"]["policy_loss"] = objective_spec(self.objective.policy_loss)
        off_policy = self.asynchronous.off_policy
        values["asynchronous"]["off_policy"] = asdict(off_policy) if off_policy is not None else None
        values["update"]["metric_hooks"] = None
        return values


def _as_block(cls: type, value: Any) -> Any:
    if value is None:
        return cls()
    return cls(**value) if isinstance(value, dict) else value


__all__ = ["BLOCKS", "BLOCK_OF", "ModuleSettings", "OBJECTIVE_KEYS", "check_config", "nest_flat_keys", "objective_from_flat_keys", "objective_spelling", "rename_note",
           "with_flat_keys"]
