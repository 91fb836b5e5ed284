"""Dynamic sampling (DAPO): train only on groups whose rewards differ.

A group whose ``G`` responses all score the same has zero advantage under every group
estimator: it costs a full forward and backward and teaches nothing. With a model that
rarely succeeds that is most groups. :class:`DynamicSampler` generates further rounds of
prompts until the step holds ``rollout_batch_size`` groups with reward variance, or
``max_extra_rounds`` more rounds were generated. Then the step is filled up with
zero-variance groups, so its size (and the mini-batch plan) never changes; those rows
train as zero-advantage rows (``skip_zero_advantage`` skips their backward).

Round 0 is the ordinary rollout with the step's seed; round ``k`` draws its prompts from
the data module's extra prompt stream (``PromptDataModule.extra_batch``, resumable) and
samples with :func:`~gspo_lightning.rollout.sampling.round_seed` ``(seed, k)``, so a run and its resume sample alike.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor

from gspo_lightning.errors import ConfigError
from gspo_lightning.rollout.sampling import round_seed
from gspo_lightning.rollout.worker import Rollout


def groups_with_variance(rewards: Tensor, group_size: int) -> Tensor:
    """``(num_groups,)`` True where a group's rewards are not all equal."""
    grouped = rewards.view(-1, group_size)
    return grouped.max(-1).values != grouped.min(-1).values


def _pad_to(tensor: Tensor, width: int, value, left: bool) -> Tensor:
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    fill = torch.full((tensor.shape[0], missing), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([fill, tensor] if left else [tensor, fill], dim=1)


def select_groups(rollouts: list[Rollout], picks: list[tuple[int, int]], pad_token_id: int) -> Rollout:
    """One rollout of the groups ``picks`` = ``[(rollout index, group index), ...]``, in that
    order; prompts are re-padded on the left and responses on the right to common widths.
    Every per-row field of a kept group comes from its own round."""
    first = rollouts[0]
    g = first.group_size
    if any(r.group_size != g or r.policy_version != first.policy_version for r in rollouts):
        raise ConfigError("select_groups merges rounds of one step: every rollout must have the same group size and policy "
                         f"version, got {[(r.group_size, r.policy_version) for r in rollouts]}")
    # the trainer's log-probs at the sampling weights exist for a round or not; mixed, none are kept
    with_behaviour = all(r.behaviour_trainer_logprobs is not None for r in rollouts)
    prompt_width = max(rollouts[i].prompt_width for i, _ in picks)
    response_width = max(rollouts[i].response_mask.shape[1] for i, _ in picks)
    parts: dict[str, list] = {k: [] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_attention",
                                             "response_mask", "engine_logprobs", "behaviour", "rewards", "truncated",
                                             "scored", "turn_of_token")}
    episodes = first.turn_of_token is not None
    components: dict[str, list[Tensor]] = {k: [] for k in first.reward_components}
    prompts, completions, turn_rewards, images = [], [], [], []
    for index, group in picks:
        r = rollouts[index]
        rows = slice(group * g, (group + 1) * g)
        p = r.prompt_width
        parts["prompt_ids"].append(_pad_to(r.input_ids[rows, :p], prompt_width, pad_token_id, left=True))
        parts["prompt_mask"].append(_pad_to(r.attention_mask[rows, :p], prompt_width, 0, left=True))
        parts["response_ids"].append(_pad_to(r.input_ids[rows, p:], response_width, pad_token_id, left=False))
        # an episode attends to the environment's tokens, which are not in its response_mask
        parts["response_attention"].append(_pad_to(r.attention_mask[rows, p:], response_width, 0, left=False))
        parts["response_mask"].append(_pad_to(r.response_mask[rows], response_width, False, left=False))
        if episodes:
            parts["turn_of_token"].append(_pad_to(r.turn_of_token[rows], response_width, -1, left=False))
        parts["engine_logprobs"].append(_pad_to(r.engine_logprobs[rows], response_width, 0.0, left=False))
        if with_behaviour:
            parts["behaviour"].append(_pad_to(r.behaviour_trainer_logprobs[rows], response_width, 0.0, left=False))
        parts["rewards"].append(r.rewards[rows])
        parts["truncated"].append(r.truncated[rows])
        parts["scored"].append(r.scored[rows] if r.scored is not None else torch.ones(g, dtype=torch.bool, device=r.rewards.device))
        for name in components:
            components[name].append(r.reward_components[name][rows])
        prompts += r.prompts[rows]
        completions += r.completions[rows]
        if episodes:
            turn_rewards += r.turn_rewards[rows]
        if first.images is not None:
            images += r.images[rows]
    response_mask = torch.cat(parts["response_mask"])
    timings: dict[str, float] = {}
    for r in rollouts:  # every round's work counts in the step's phases
        for name, seconds in r.timings.items():
            timings[name] = timings.get(name, 0.0) + seconds
    return replace(
        first,
        input_ids=torch.cat([torch.cat(parts["prompt_ids"]), torch.cat(parts["response_ids"])], dim=1),
        attention_mask=torch.cat([torch.cat(parts["prompt_mask"]), torch.cat(parts["response_attention"])], dim=1),
        prompt_width=prompt_width,
        response_mask=response_mask,
        engine_logprobs=torch.cat(parts["engine_logprobs"]),
        behaviour_trainer_logprobs=torch.cat(parts["behaviour"]) if with_behaviour else None,
        rewards=torch.cat(parts["rewards"]),
        reward_components={name: torch.cat(values) for name, values in components.items()},
        truncated=torch.cat(parts["truncated"]),
        prompts=prompts,
        completions=completions,
        scored=torch.cat(parts["scored"]) if any(r.scored is not None for r in rollouts) else None,
        timings=timings,
        reward_errors=sum(r.reward_errors for r in rollouts),
        reward_stats={name: sum(r.reward_stats.get(name, 0.0) for r in rollouts) for name in first.reward_stats},
        turn_of_token=torch.cat(parts["turn_of_token"]) if episodes else None,
        turn_rewards=turn_rewards if episodes else None,
        episode_stats=_mean_stats([r.episode_stats for r in rollouts]),
        images=images if first.images is not None else None,
    )


def _mean_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """The episodes' counts over every round of the step (each round's mean, averaged; the
    agents' counts, ``agent/...``, summed: they are the step's totals)."""
    names = {name for s in stats for name in s}
    return {name: sum(s.get(name, 0.0) for s in stats) / (1 if name.startswith("agent/") else len(stats))
            for name in sorted(names)}


class DynamicSampler:
    """Fills a step with groups that have reward variance (see the module docstring).

    Args:
        max_extra_rounds: generation rounds after the first, at most (0: filter only, never
            generate more; the step is then filled up with zero-variance groups).
    """

    def __init__(self, max_extra_rounds: int):
        if max_extra_rounds < 0:
            raise ConfigError(f"max_sampling_rounds must be >= 0 (extra generation rounds per step), got {max_extra_rounds}")
        self.max_extra_rounds = max_extra_rounds

    def fill(
        self,
        batch: dict,
        generate: Callable[[dict, int], Rollout],
        more_prompts: Callable[[], dict],
        *,
        seed: int,
        pad_token_id: int,
    ) -> tuple[Rollout, dict[str, float]]:
        """``(rollout, metrics)``: ``len(batch["prompt_ids"])`` groups, those with reward
        variance first. ``generate(batch, seed)`` makes a rollout; ``more_prompts()`` the next
        batch of the extra prompt stream."""
        target = len(batch["prompt_ids"])
        rollouts = [generate(batch, seed)]
        kept: list[tuple[int, int]] = []
        flat: list[tuple[int, int]] = []
        generated = zero_variance = 0
        round_index = 0
        while True:
            rollout = rollouts[round_index]
            varied = groups_with_variance(rollout.rewards, rollout.group_size).tolist()
            generated += len(varied)
            zero_variance += varied.count(False)
            kept += [(round_index, group) for group, v in enumerate(varied) if v]
            flat += [(round_index, group) for group, v in enumerate(varied) if not v]
            if len(kept) >= target or round_index == self.max_extra_rounds:
                break
            round_index += 1
            rollouts.append(generate(more_prompts(), round_seed(seed, round_index)))
        picks = kept[:target]
        filled = flat[:target - len(picks)]  # the cap was hit: zero-variance groups keep the step's size
        # groups keep their generation order, so a step that needed no extra round is the plain rollout
        picks = sorted(picks + filled)
        metrics = {
            "dynamic_sampling/rounds": float(round_index + 1),
            "dynamic_sampling/zero_variance_share": zero_variance / generated,
            "dynamic_sampling/groups_generated": float(generated),
            "dynamic_sampling/groups_dropped": float(generated - target),
            "dynamic_sampling/groups_filled": float(len(filled)),
        }
        if len(rollouts) == 1:  # one round: the step trains on its own rollout, as without filtering
            return rollouts[0], metrics
        return select_groups(rollouts, picks, pad_token_id), metrics


__all__ = ["DynamicSampler", "groups_with_variance", "select_groups"]
