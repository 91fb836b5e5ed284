"""Per-step metrics accumulated with torchmetrics, so they reduce correctly across
micro-batches and data-parallel ranks (``compute`` syncs the states of all processes)."""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor, nn
from torchmetrics.aggregation import MaxMetric, MeanMetric, MinMetric, SumMetric

_KINDS = {"mean": MeanMetric, "max": MaxMetric, "min": MinMetric, "sum": SumMetric}


class StepMetrics(nn.Module):
    """Named running aggregates. Every rank must update the same names in the same order."""

    def __init__(self) -> None:
        super().__init__()
        self.aggregates = nn.ModuleDict()
        self.kinds: dict[str, str] = {}
        self.updated: set[str] = set()  # names updated since the last compute
        # moves with the LightningModule: aggregates are created on its device, because the
        # process group syncs them there (NCCL has no CPU backend: a float's CPU aggregate broke
        # every multi-process GPU run)
        self.register_buffer("device_anchor", torch.empty(0), persistent=False)

    @staticmethod
    def _key(name: str) -> str:
        return name.replace(".", "·").replace("/", "__")  # ModuleDict keys cannot hold dots

    def update(self, name: str, value: Union[Tensor, float], weight: Union[Tensor, float] = 1.0, kind: str = "mean") -> None:
        key = self._key(name)
        if key not in self.aggregates:
            self.aggregates[key] = _KINDS[kind](nan_strategy="ignore", sync_on_compute=True).to(self.device_anchor.device)
            self.kinds[name] = kind
        metric = self.aggregates[key]
        self.updated.add(name)
        value = torch.as_tensor(value, dtype=torch.float32, device=metric.device).detach()
        if kind == "mean":
            weight = torch.as_tensor(weight, dtype=torch.float32, device=metric.device).detach()
            metric.update(value, weight.expand_as(value) if value.dim() else weight)
        else:
            metric.update(value)

    def compute(self) -> dict[str, float]:
        """The aggregates updated since the last call, as floats, and NaN for every name seen
        before but not updated since (Lightning's loggers would repeat its last value in
        every later row otherwise); then reset for the next step."""
        out = {}
        for name in self.kinds:  # same order on every rank: compute() syncs collectively
            if name not in self.updated:
                out[name] = float("nan")  # not measured this step
                continue
            metric = self.aggregates[self._key(name)]
            out[name] = float(metric.compute())
            metric.reset()
        self.updated.clear()
        return out


class ConstantRewardWatch:
    """Notices a reward function that gives every sample of a step one value, step after step:
    it teaches nothing (a judge whose replies never parse, a reward model fed the wrong text,
    a task too hard to ever score). Says so once per function, after ``steps`` such steps in a row."""

    def __init__(self, steps: int = 20):
        self.steps = steps
        self.streaks: dict[str, int] = {}
        self.said: set[str] = set()

    def update(self, components: dict[str, Tensor]) -> list[str]:
        """This step's scores per function (NaN: unscored); the lines to say now."""
        lines = []
        for name, values in components.items():
            scored = values[~values.isnan()]
            if scored.numel() == 0:
                continue  # nothing scored: the failure counts say it
            same = bool((scored == scored[0]).all())
            self.streaks[name] = self.streaks.get(name, 0) + 1 if same else 0
            if self.streaks[name] >= self.steps and name not in self.said:
                self.said.add(name)
                lines.append(f"reward {name!r} gave every sample the same score ({float(scored[0]):g} at the last step) "
                             f"for {self.steps} steps in a row: it adds no learning signal; check it (a judge's "
                             f"replies, a reward model's inputs) or the task's difficulty")
        return lines


def record_rollout(metrics: StepMetrics, rollout, advantages: Tensor) -> None:
    """Rewards, group spread, lengths and truncation of one rollout (``rollout/worker.py``)."""
    m = metrics
    rewards = rollout.rewards
    # a response no reward function scored has no reward: it joins no mean, spread or group count
    scored = rollout.scored if rollout.scored is not None else torch.ones_like(rewards, dtype=torch.bool)
    count = scored.sum()
    kept = torch.where(scored, rewards, torch.zeros_like(rewards))
    m.update("reward/mean", kept.sum() / count.clamp(min=1), count)  # weight 0 on a rank with no score
    m.update("reward/sq_mean", kept.square().sum() / count.clamp(min=1), count)
    m.update("reward/unscored_frac", (~scored).float().mean(), rewards.numel())
    for name, values in rollout.reward_components.items():
        scored = ~values.isnan()  # a function may return None (no score) for some samples
        if scored.any():
            m.update(f"reward/{name}", values[scored].mean(), scored.sum())
    # a group teaches nothing when its scored rewards are all equal or fewer than two are scored
    group_scored = scored.view(-1, rollout.group_size)
    high = torch.where(group_scored, rewards.view(-1, rollout.group_size), -torch.inf).max(-1).values
    low = torch.where(group_scored, rewards.view(-1, rollout.group_size), torch.inf).min(-1).values
    zero_std = ((group_scored.sum(-1) < 2) | (high == low)).float()
    m.update("reward/zero_std_groups", zero_std.mean(), zero_std.numel())
    lengths = rollout.lengths.float()
    m.update("response/length_mean", lengths.mean(), lengths.numel())
    m.update("response/length_max", lengths.max(), kind="max")
    m.update("response/truncated_frac", rollout.truncated.float().mean(), lengths.numel())
    valid = rollout.response_mask
    m.update("advantage/mean", advantages[valid].mean() if valid.any() else 0.0, valid.sum())
    m.update("reward/errors", float(rollout.reward_errors), kind="max")
    for name, value in rollout.reward_stats.items():  # reward/<name>/failed: the step's totals over every rank
        m.update(name, value, kind="sum")
    for name, value in rollout.episode_stats.items():  # episodes: turns, tool calls and errors, endings
        if name.startswith("agent/"):  # the agents' counts: the step's totals over every rank
            m.update(name, value, kind="sum")
        elif name != "episode/environment_token_frac":
            m.update(name, value, lengths.numel())
    if rollout.turn_of_token is not None:
        # a ratio of tokens, weighted by tokens: the same over any number of ranks (and over the
        # rows a step keeps), where the runner's per-batch ratio weighted by episodes is not
        tokens = rollout.attention_mask[:, rollout.prompt_width:].bool()
        environment = (tokens & ~rollout.response_mask).sum()
        m.update("episode/environment_token_frac", environment / tokens.sum().clamp(min=1), tokens.sum())


def step_values(metrics: StepMetrics, rollout, advantages: Tensor, timings: dict[str, float], elapsed: float) -> dict[str, float]:
    """Everything a training step logs from its aggregates: the rollout's (:func:`record_rollout`),
    the phases' ``timings``, the step's time and throughput, then every aggregate of the step
    (computed, which resets them), with ``reward/std`` from the mean and the mean square."""
    record_rollout(metrics, rollout, advantages)
    for name, value in timings.items():
        metrics.update(name, value)
    metrics.update("time/step", elapsed)
    metrics.update("perf/samples_per_s", rollout.num_responses / elapsed)
    metrics.update("perf/tokens_per_s", rollout.attention_mask.sum() / elapsed)
    values = metrics.compute()
    sq_mean = values.pop("reward/sq_mean")
    values["reward/std"] = max(0.0, sq_mean - values["reward/mean"] ** 2) ** 0.5
    return values


def eval_step(trainer, pl_module) -> int:
    """The step an evaluation is of (its metrics' ``step``, its ``eval_results.jsonl`` line):
    Lightning's step in ``fit``; in ``validate`` / ``test``, which restore a checkpoint's weights
    but not Lightning's counter, the module's (``rollout_steps``)."""
    return trainer.global_step if trainer.state.fn == "fit" else getattr(pl_module, "rollout_steps", trainer.global_step)
