"""From rewards to advantages, as pure functions, in the order of ``docs/algorithm.md``:

1. combine weighted rewards into one score per response (done by ``rewards/``)
2. normalize the scores (``reward_norm`` with ``reward_shift`` / ``reward_scale``)
3. clip them (``reward_clip``)
4. token rewards: the score on the last response token, minus ``kl_coef * KL(old, ref)``
   on every token when ``add_token_level_kl``
5. the estimator (``grpo``, ``reinforce``, ``rloo``, ``dr_grpo``)
6. whiten over all valid tokens (``whiten_advantages``)
7. clip (``advantage_clip``)

Responses of one group (same prompt) are contiguous: rows ``g*G .. g*G+G-1``.
Standard deviations are unbiased (Bessel), as in TRL and verl; a group or batch with a
single value or identical values has std 0 and normalizes to 0, never NaN.

A response no reward function scored (``scored`` False: every function returned ``None``)
is left out of every statistic (group, batch, running, whitening) and gets advantage 0;
a group with fewer than two scored responses has nothing to compare and teaches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from gspo_lightning.errors import ConfigError
from gspo_lightning.objective.terms import kl_penalty
from gspo_lightning.objective.options import AdvEstimator, RewardNorm, check_choice, choices

REWARD_NORMS = (None, *choices(RewardNorm))
ADV_ESTIMATORS = choices(AdvEstimator)

# all_reduce(sum) over data-parallel ranks; the identity on one process.
SumReducer = Callable[[Tensor], Tensor]


def _identity(x: Tensor) -> Tensor:
    return x


def moments(values: Tensor, mask: Optional[Tensor] = None, reduce_sum: SumReducer = _identity) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean, unbiased std, count)`` of the (masked) values, summed over ranks by ``reduce_sum``.

    Two passes (mean, then squared deviations) in float64: E[x^2] - mean^2 loses every
    digit when the values sit far from zero.
    """
    values = values.double()
    weights = torch.ones_like(values) if mask is None else mask.double()
    values = torch.where(weights > 0, values, torch.zeros_like(values))
    stats = reduce_sum(torch.stack([weights.sum(), (values * weights).sum()]))
    count = stats[0]
    mean = stats[1] / count.clamp(min=1)
    sq_dev = reduce_sum(((values - mean).square() * weights).sum())
    var = sq_dev / (count - 1).clamp(min=1)
    return mean, var.sqrt(), count


def group_view(values: Tensor, group_size: int) -> Tensor:
    if values.dim() != 1 or values.numel() % group_size != 0:
        raise ConfigError(
            f"expected one value per response with groups of {group_size} contiguous responses, "
            f"got shape {tuple(values.shape)}"
        )
    return values.view(-1, group_size)


def group_count(scored: Optional[Tensor], group_size: int, num_responses: int) -> Tensor:
    """Per-response number of scored responses in its group (``scored`` None: ``group_size``)."""
    if scored is None:
        return torch.full((num_responses,), float(group_size))
    return group_view(scored.float(), group_size).sum(-1, keepdim=True).expand(-1, group_size).reshape(-1)


def group_mean_std(values: Tensor, group_size: int, scored: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Per-response mean and unbiased std of the scored responses of its group (``scored``
    None: all); std 0 where the group has fewer than two."""
    grouped = group_view(values, group_size)
    weights = torch.ones_like(grouped) if scored is None else group_view(scored, group_size).to(grouped.dtype)
    grouped = torch.where(weights > 0, grouped, torch.zeros_like(grouped))
    count = weights.sum(-1, keepdim=True)
    mean = (grouped * weights).sum(-1, keepdim=True) / count.clamp(min=1)
    sq_dev = ((grouped - mean).square() * weights).sum(-1, keepdim=True)
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()  # 0 for one value: its deviation is 0
    return mean.expand_as(grouped).reshape(-1), std.expand_as(grouped).reshape(-1)


class RunningMoments:
    """Mean and std of every reward seen so far (Chan et al.'s parallel update, in float64).

    Its state survives checkpoints through :meth:`state_dict` / :meth:`load_state_dict`.
    """

    def __init__(self) -> None:
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    def update(self, values: Tensor, reduce_sum: SumReducer = _identity, mask: Optional[Tensor] = None) -> None:
        batch_mean, batch_std, batch_count = moments(values, mask, reduce_sum=reduce_sum)
        n_b = float(batch_count)
        if n_b == 0:
            return
        m2_b = float(batch_std) ** 2 * max(n_b - 1.0, 0.0)
        n_a, total = self.count, self.count + n_b
        delta = float(batch_mean) - self.mean
        self.mean += delta * n_b / total
        self.m2 += m2_b + delta * delta * n_a * n_b / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / (self.count - 1.0)) ** 0.5 if self.count > 1 else 0.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


def normalize_rewards(
    rewards: Tensor,
    group_size: int,
    reward_norm: Optional[str] = None,
    *,
    reward_shift: bool = False,
    reward_scale: bool = False,
    running: Optional[RunningMoments] = None,
    eps: float = 1e-6,
    reduce_sum: SumReducer = _identity,
    scored: Optional[Tensor] = None,
) -> Tensor:
    """Step 2: ``(r - mean) / (std + eps)`` over the group, the batch or the running history,
    whose statistics take the ``scored`` responses only (``None``: all).

    ``reward_shift`` only subtracts the mean, ``reward_scale`` only divides by the std (both
    need a ``reward_norm``). ``running`` is updated with this batch before it is used.
    """
    check_choice("reward_norm", reward_norm, RewardNorm, allow_none=True)
    if reward_shift and reward_scale:
        raise ConfigError("reward_shift and reward_scale are exclusive: set one (or neither, for both shift and scale)")
    if reward_norm is None:
        if reward_shift or reward_scale:
            raise ConfigError("reward_shift / reward_scale need a reward_norm (group, batch or running) to take statistics from")
        return rewards
    if reward_norm == "group":
        mean, std = group_mean_std(rewards, group_size, scored)
    elif reward_norm == "batch":
        m, s, _ = moments(rewards, scored, reduce_sum=reduce_sum)
        mean, std = m.to(rewards.dtype), s.to(rewards.dtype)
    else:
        if running is None:
            raise ConfigError("reward_norm='running' needs a RunningMoments state")
        running.update(rewards, reduce_sum=reduce_sum, mask=scored)
        mean = torch.tensor(running.mean, dtype=rewards.dtype, device=rewards.device)
        std = torch.tensor(running.std, dtype=rewards.dtype, device=rewards.device)
    if reward_shift:
        return rewards - mean
    if reward_scale:
        return rewards / (std + eps)
    return (rewards - mean) / (std + eps)


def symmetric_clip(values: Tensor, bound: Optional[float]) -> Tensor:
    """``clamp(values, -bound, bound)``; ``None`` leaves them as they are."""
    if bound is None:
        return values
    return values.clamp(-bound, bound)


clip_rewards = symmetric_clip  # step 3 (reward_clip)
clip_advantages = symmetric_clip  # step 7 (advantage_clip)


def token_level_rewards(
    scores: Tensor,
    mask: Tensor,
    *,
    old_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k1",
) -> Tensor:
    """Step 4: ``(B, T)`` rewards, the score on each response's last valid token, minus
    ``kl_coef * KL(old, ref)`` on every valid token when reference log-probs are given."""
    valid = mask.bool()
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    # the last *valid* position (masks may have holes or leading zeros)
    last = torch.where(valid, positions, -1).max(-1).values
    has_tokens = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows[has_tokens], last[has_tokens]] = scores[has_tokens]
    if ref_logprobs is not None and kl_coef != 0.0:
        if old_logprobs is None:
            raise ConfigError("token-level KL needs old_logprobs")
        kl = kl_penalty(old_logprobs, ref_logprobs, kl_estimator).to(scores.dtype)
        rewards = rewards - kl_coef * torch.where(valid, kl, torch.zeros_like(kl))
    return rewards


def compute_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    group_size: int,
    estimator: str = "grpo",
    *,
    eps: float = 1e-6,
    scored: Optional[Tensor] = None,
) -> Tensor:
    """Step 5: ``(B, T)`` advantages from ``(B, T)`` token rewards.

    - ``grpo``: ``(R_i - mean_group) / (std_group + eps)`` with ``R_i`` the sum of the
      response's token rewards, the same on every token.
    - ``reinforce``: return-to-go (gamma = 1) of the token rewards.
    - ``rloo``: ``R_i`` minus the mean of the other ``G - 1`` responses of the group.
    - ``dr_grpo``: ``R_i - mean_group`` (no std division).

    Group statistics take the ``scored`` responses only (``None``: all): ``G`` is then the
    group's number of scored responses. Unscored responses get advantage 0.
    """
    valid = mask.bool() if scored is None else mask.bool() & scored[:, None]
    token_rewards = torch.where(valid, token_rewards, torch.zeros_like(token_rewards))
    if estimator == "reinforce":
        returns = token_rewards.flip(-1).cumsum(-1).flip(-1)
        return torch.where(valid, returns, torch.zeros_like(returns))
    check_choice("adv_estimator", estimator, AdvEstimator)
    if group_size < 2:
        raise ConfigError(f"adv_estimator={estimator!r} compares responses within a group: it needs num_return_sequences_in_group >= 2")
    scores = token_rewards.sum(-1)
    mean, std = group_mean_std(scores, group_size, scored)
    if estimator == "grpo":
        per_response = (scores - mean) / (std + eps)
    elif estimator == "rloo":  # with k scored responses: R_i minus the mean of the other k - 1
        k = group_count(scored, group_size, len(scores)).to(scores)
        per_response = (scores - mean) * k / (k - 1).clamp(min=1)  # k = 1: R_i - R_i = 0
    else:
        per_response = scores - mean
    return torch.where(valid, per_response[:, None].expand_as(token_rewards), torch.zeros_like(token_rewards))


def whiten(values: Tensor, mask: Tensor, *, eps: float = 1e-6, reduce_sum: SumReducer = _identity) -> Tensor:
    """Step 6: ``(A - mean) / (std + eps)`` over all valid tokens (of all ranks)."""
    mean, std, _ = moments(values, mask, reduce_sum=reduce_sum)
    out = (values - mean.to(values.dtype)) / (std.to(values.dtype) + eps)
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def rewards_to_advantages(
    scores: Tensor,
    mask: Tensor,
    group_size: int,
    *,
    adv_estimator: str = "grpo",
    reward_norm: Optional[str] = None,
    reward_shift: bool = False,
    reward_scale: bool = False,
    reward_clip: Optional[float] = None,
    running: Optional[RunningMoments] = None,
    add_token_level_kl: bool = False,
    old_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k1",
    whiten_advantages: bool = False,
    advantage_clip: Optional[float] = None,
    eps: float = 1e-6,
    reduce_sum: SumReducer = _identity,
    scored: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Steps 2-7 in order. Returns ``(normalized scores (B,), advantages (B, T))``.

    ``reduce_sum`` sums statistics over data-parallel ranks for the batch-wide steps
    (batch / running normalization, whitening); group steps need whole groups on one rank.
    ``scored`` (B,) is False for responses no reward function scored: they join no
    statistic and get advantage 0 (``None``: every response was scored).
    """
    scores = normalize_rewards(
        scores, group_size, reward_norm, reward_shift=reward_shift, reward_scale=reward_scale,
        running=running, eps=eps, reduce_sum=reduce_sum, scored=scored,
    )
    scores = clip_rewards(scores, reward_clip)
    if add_token_level_kl and ref_logprobs is None:
        raise ConfigError("add_token_level_kl needs reference log-probs")
    token_rewards = token_level_rewards(
        scores, mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs if add_token_level_kl else None,
        kl_coef=kl_coef, kl_estimator=kl_estimator,
    )
    if scored is not None:
        mask = mask.bool() & scored[:, None]  # from here on an unscored response is no valid token
    advantages = compute_advantages(token_rewards, mask, group_size, adv_estimator, eps=eps, scored=scored)
    if whiten_advantages:
        advantages = whiten(advantages, mask, eps=eps, reduce_sum=reduce_sum)
    advantages = clip_advantages(advantages, advantage_clip)
    return scores, advantages


def episode_returns(outcome: Tensor, turn_rewards: list[list[float]], discount: float = 1.0) -> list[list[float]]:
    """The return from each turn of each episode: the environment's rewards of that turn and the
    later ones, then the episode's outcome (the reward functions' score) after its last turn,
    each discounted by ``discount`` per turn: ``G[k] = sum_{j >= k} d^(j-k) r[j] + d^(K-1-k) R``."""
    returns = []
    for final, rewards in zip(outcome.tolist(), turn_rewards):
        to_go, out = final, []
        for reward in reversed(rewards or [0.0]):
            to_go = reward + (to_go if not out else discount * to_go)
            out.append(to_go)
        returns.append(out[::-1])
    return returns


def turn_advantages(outcome: Tensor, turn_rewards: list[list[float]], turn_of_token: Tensor, group_size: int, *,
                    discount: float = 1.0, scale: bool = True, scored: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """GSPO-token's per-turn advantages for episodes: ``(B, T)``, 0 off the model's tokens.

    Each model token gets its turn's return ``G[i, k]`` (:func:`episode_returns`) minus the mean
    of its group's episode returns ``G[., 0]``, divided by their std when ``scale`` (GRPO's
    normalization, with the group as baseline). With no turn rewards and ``discount`` 1 every
    turn's return is the episode's reward, and this is the sequence-level GRPO advantage."""
    returns = episode_returns(outcome, turn_rewards, discount)
    first = torch.tensor([r[0] for r in returns], dtype=torch.float32, device=outcome.device)
    mean, std = group_mean_std(first, group_size, scored)
    width = turn_of_token.shape[1]
    table = torch.zeros((len(returns), max(len(r) for r in returns)), dtype=torch.float32, device=outcome.device)
    for row, values in enumerate(returns):
        table[row, :len(values)] = torch.tensor(values, dtype=torch.float32)
    per_token = table.gather(1, turn_of_token.clamp(min=0).clamp(max=table.shape[1] - 1)[:, :width])
    advantages = (per_token - mean[:, None]) / ((std[:, None] + eps) if scale else 1.0)
    if scored is not None:
        advantages = advantages * scored[:, None].to(advantages.dtype)
    return torch.where(turn_of_token >= 0, advantages, torch.zeros_like(advantages))


# estimators that compare the responses of one prompt (they need G >= 2)
GROUP_ESTIMATORS = ("grpo", "rloo", "dr_grpo")


@dataclass
class Advantages:
    """From rewards to advantages (this module's steps 2-7, docs/algorithm.md).

    Args:
        adv_estimator: ``grpo``, ``reinforce``, ``rloo`` or ``dr_grpo``.
        reward_norm: ``null``, ``group``, ``batch`` or ``running`` normalization of rewards.
        reward_shift: with ``reward_norm``, only subtract the mean.
        reward_scale: with ``reward_norm``, only divide by the std.
        reward_clip: clip rewards to ``[-c, c]`` after normalization (``null``: off).
        add_token_level_kl: put ``-kl_coef * KL(old, ref)`` into every token's reward.
        kl_coef: coefficient of the token-level KL reward.
        whiten_advantages: whiten advantages over all valid tokens of the batch.
        advantage_clip: clip advantages to ``[-c, c]`` (``null``: off).
    """

    adv_estimator: AdvEstimator = "grpo"
    reward_norm: Optional[RewardNorm] = None
    reward_shift: bool = False
    reward_scale: bool = False
    reward_clip: Optional[float] = None
    add_token_level_kl: bool = False
    kl_coef: float = 0.0
    whiten_advantages: bool = False
    advantage_clip: Optional[float] = None

    @property
    def compares_within_groups(self) -> bool:
        return self.adv_estimator in GROUP_ESTIMATORS

    def problems(self, *, group_size: int) -> list[str]:
        problems = []
        for name, option, allow_none in (("adv_estimator", AdvEstimator, False), ("reward_norm", RewardNorm, True)):
            try:
                check_choice(name, getattr(self, name), option, allow_none=allow_none)
            except ValueError as err:
                problems.append(str(err))
        if self.compares_within_groups and group_size < 2:
            problems.append(f"adv_estimator={self.adv_estimator} compares responses of a prompt: set "
                            f"num_return_sequences_in_group >= 2 (or use reinforce)")
        if self.reward_norm == "group" and group_size < 2:
            problems.append("reward_norm=group needs num_return_sequences_in_group >= 2")
        for name in ("reward_clip", "advantage_clip", "kl_coef"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.reward_shift or self.reward_scale) and self.reward_norm is None:
            problems.append("reward_shift / reward_scale act only with a reward_norm: set reward_norm (group, batch or "
                            "running) or turn them off")
        if self.reward_shift and self.reward_scale:
            problems.append("reward_shift and reward_scale are exclusive (set neither to both shift and scale)")
        if self.add_token_level_kl and self.kl_coef == 0:
            problems.append("add_token_level_kl needs kl_coef > 0")
        return problems

    def surprises(self) -> list[str]:
        if self.reward_norm in ("group", "batch") and (self.reward_shift or self.reward_scale):
            which = "reward_shift" if self.reward_shift else "reward_scale"
            meaning = "subtract the mean only" if self.reward_shift else "divide by the std only"
            return [f"{which} with reward_norm={self.reward_norm}: here it means {meaning}; ROLL honours {which} only "
                    f"with reward_norm=running and ignores it otherwise"]
        return []

    def compute(self, scores: Tensor, mask: Tensor, group_size: int, *, running: Optional[RunningMoments],
                old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor], kl_estimator: str,
                reduce_sum: SumReducer = _identity, scored: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """:func:`rewards_to_advantages` with this block's settings."""
        return rewards_to_advantages(
            scores, mask, group_size, adv_estimator=self.adv_estimator, reward_norm=self.reward_norm,
            reward_shift=self.reward_shift, reward_scale=self.reward_scale, reward_clip=self.reward_clip, running=running,
            add_token_level_kl=self.add_token_level_kl, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
            kl_coef=self.kl_coef, kl_estimator=kl_estimator, whiten_advantages=self.whiten_advantages,
            advantage_clip=self.advantage_clip, reduce_sum=reduce_sum, scored=scored,
        )
