"""Fresh rollouts: push new weights to the engine, generate, decode, score.

The :class:`RolloutWorker` is built from the config (an engine chosen by ``class_path``,
the reward functions, the sampling settings) and called explicitly from the module's
training and evaluation steps, so every rollout is sampled with the weights of the
latest update: Lightning prefetches prompt batches, never rollouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from gspo_lightning.episodes.multi_turn import MultiTurn
from gspo_lightning.errors import ConfigError
from gspo_lightning.models.vision import ImageRenderer, is_vision_language, load_image_processor
from gspo_lightning.rewards.base import RewardComposer
from gspo_lightning.rollout.engine import EngineSpec, Generation, RolloutEngine, SamplingParams, WeightsIterator, WeightsSource
from gspo_lightning.rollout.episodes import run_episodes
from gspo_lightning.rollout.hf import left_pad
from gspo_lightning.rollout.scoring import GroupScorer, RewardLoop, streams
from gspo_lightning.rollout.transport import InProcessTransport, WeightTransport


@dataclass
class Rollout:
    """One step's responses, as tensors on the trainer's device.

    ``input_ids`` is ``[left-padded prompt | right-padded response]``; response ``j``
    answers prompt ``j // group_size``, so groups are contiguous rows.
    """

    input_ids: Tensor  # (N, P + R)
    attention_mask: Tensor  # (N, P + R)
    prompt_width: int  # P
    response_mask: Tensor  # (N, R) bool
    engine_logprobs: Tensor  # (N, R) sampled-token log-probs from the engine
    rewards: Tensor  # (N,) weighted sum of the reward functions
    reward_components: dict[str, Tensor]  # name -> (N,)
    truncated: Tensor  # (N,) bool
    group_size: int
    policy_version: int
    prompts: list[Any] = field(repr=False)
    completions: list[str] = field(repr=False)
    scored: Optional[Tensor] = None  # (N,) bool: False where no reward function gave a score
    timings: dict[str, float] = field(default_factory=dict)
    reward_errors: int = 0
    # reward/<name>/failed: samples a judge or reward model left unscored (summed over ranks)
    reward_stats: dict[str, float] = field(default_factory=dict)
    # the trainer's log-probs at the weights that sampled (o_b), when the producer kept them
    # (an asynchronous producer with a float32 copy): the clip budget's numerics / staleness split
    behaviour_trainer_logprobs: Optional[Tensor] = None
    # multi-turn episodes only: the turn of each model token (-1 on the environment's tokens, which
    # are in attention_mask but not in response_mask), the environment's reward after each turn,
    # and the episodes' counts (turns, tool calls, endings) for the step's metrics
    turn_of_token: Optional[Tensor] = None
    turn_rewards: Optional[list[list[float]]] = None
    episode_stats: dict[str, float] = field(default_factory=dict)
    # a vision-language policy's prompts: each row's image inputs (models/vision.py; the rows of a
    # group share one entry, so the trainer runs the vision tower once per prompt), None: no images
    images: Optional[list] = field(default=None, repr=False)

    def images_of(self, rows: Tensor) -> Optional[list]:
        """The image inputs of ``rows`` (``None`` without images)."""
        return None if self.images is None else [self.images[i] for i in rows.tolist()]

    @property
    def num_responses(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> Tensor:
        """The model's own tokens per response (an episode's environment tokens not counted)."""
        return self.response_mask.sum(-1)


def build_rollout_tensors(
    prompt_ids: list[list[int]],
    generation: Generation,
    group_size: int,
    pad_token_id: int,
    device: torch.device,
    loss_mask: Optional[Tensor] = None,
) -> dict[str, Any]:
    """Tensors of a rollout from prompts and an engine's generation.

    ``loss_mask`` (episodes): the model's own tokens among the generation's; the others (the
    environment's) are attended to but get no loss, KL, entropy or length."""
    expanded = [p for p in prompt_ids for _ in range(group_size)]
    prompt_tensor, prompt_mask = left_pad(expanded, pad_token_id, device)
    in_sequence = generation.mask.to(device)
    response_mask = in_sequence if loss_mask is None else loss_mask.to(device) & in_sequence
    completion_ids = generation.completion_ids.to(device).masked_fill(~in_sequence, pad_token_id)
    return {
        "input_ids": torch.cat([prompt_tensor, completion_ids], dim=1),
        "attention_mask": torch.cat([prompt_mask, in_sequence.long()], dim=1),
        "prompt_width": prompt_tensor.shape[1],
        "response_mask": response_mask,
        "engine_logprobs": generation.logprobs.to(device=device, dtype=torch.float32).masked_fill(~response_mask, 0.0),
        "truncated": generation.truncated.to(device),
    }


class RolloutWorker:
    """An engine, the reward functions and the sampling settings of training and evaluation.

    Args:
        engine: the generation engine (started later with :meth:`start`).
        rewards: scores completions.
        tokenizer: decodes completions for the reward functions.
        train_params / group_size: sampling of training rollouts, ``G`` responses per prompt.
        eval_params / eval_group_size: sampling of validation and test rollouts.
        transport: how weights reach the engine (in this process by default: every engine the
            worker drives lives here; a rollout server's client engine has its own transport).
        episodes: multi-turn episodes with an environment (``None``: one completion per sample).
        score_while_generating: start ``async def`` reward functions (a judge) on each group as
            its responses end, while the rest generate (engines that report groups: ``HFEngine``);
            the scores are the same either way.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        rewards: RewardComposer,
        tokenizer,
        *,
        train_params: SamplingParams,
        group_size: int,
        eval_params: SamplingParams,
        eval_group_size: int,
        transport: Optional[WeightTransport] = None,
        episodes: Optional[MultiTurn] = None,
        score_while_generating: bool = True,
    ):
        self.engine = engine
        self.episodes = episodes
        self.rewards = rewards
        self.tokenizer = tokenizer
        self.train_params = train_params
        self.group_size = group_size
        self.eval_params = eval_params
        self.eval_group_size = eval_group_size
        self.transport = transport or InProcessTransport()
        self.agents = None  # the agent endpoint and the agents (episodes.agent), built at start
        self.score_while_generating = score_while_generating
        self.reward_loop: Optional[RewardLoop] = None  # started by the first rollout scored group by group
        self.started = False

    def start(self, spec: EngineSpec) -> None:
        if not self.started:
            self.engine.start(spec)
            if self.episodes is not None:
                renderer = None
                if spec.policy is not None and is_vision_language(spec.policy):  # environments may reply with images
                    renderer = ImageRenderer(self.tokenizer, load_image_processor(spec.model_name_or_path,
                                                                                  spec.trust_remote_code))
                self.episodes.start(self.tokenizer, spec.prompt_length, lockstep=spec.lockstep, image_renderer=renderer)
                if self.episodes.agent is not None:
                    from gspo_lightning.rollout.agent.runner import AgentRunner

                    self.agents = AgentRunner(self.episodes, model_name=spec.model_name_or_path, local_rank=spec.local_rank)
                    self.agents.start()
            self.started = True

    def sync_weights(self, version: int, policy_weights: WeightsSource) -> dict[str, float]:
        """Push the policy's weights of ``version`` unless the engine holds them already
        (``policy_weights()`` is called only then)."""
        if self.engine.shares_policy_weights:
            self.engine.weights_version = version
            return {}
        if not self.engine.needs_weights(version):
            return {}
        return self._push(policy_weights(), version)

    def _push(self, weights: WeightsIterator, version: int) -> dict[str, float]:
        """Send ``weights`` over the transport and have the engine load them; timed."""
        start = time.perf_counter()
        _, stats = self.transport.push(
            weights, version, lambda manifest: self.engine.update_weights(self.transport.receive(manifest), version))
        return {"time/weight_sync": time.perf_counter() - start, "weight_sync/bytes": float((stats or {}).get("bytes", 0.0))}

    def capture_weights(self, version: int, policy_weights: WeightsSource
                        ) -> tuple[Optional[Callable[[], dict[str, float]]], dict[str, float]]:
        """A CPU copy of the weights of ``version`` taken now, and the push that sends it later.

        For a producer thread (``max_staleness >= 1``): the copy is taken on the training
        thread between optimizer steps (gathering sharded weights is a collective), and the
        slow part, sending it to the engine (files, HTTP, the engine's load), runs beside the
        next update. Returns ``(push, timings)``; ``push`` is ``None`` when the engine holds
        these weights already. The copy costs one full set of weights in host memory until
        it is sent."""
        if self.engine.shares_policy_weights:
            raise ConfigError(f"{type(self.engine).__name__} samples from the policy's own weights: nothing to capture")
        if not self.engine.needs_weights(version):
            return None, {}
        start = time.perf_counter()
        copy = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in policy_weights()]
        captured = time.perf_counter() - start

        def push() -> dict[str, float]:
            timings = self._push(iter(copy), version)
            copy.clear()  # sent: the host memory goes back
            return timings

        return push, {"time/weight_capture": captured}

    def rollout(self, batch: dict, *, seed: int, device: torch.device, evaluation: bool = False) -> Rollout:
        """Generate and score responses for a batch of prompts from the data module."""
        if self.episodes is not None:
            return self._episode_rollout(batch, seed=seed, device=device, evaluation=evaluation)
        group_size = self.eval_group_size if evaluation else self.group_size
        params = self.eval_params if evaluation else self.train_params
        timings = {}

        raw_prompts = batch.get("prompts", batch["prompt_text"])
        # async reward functions (a judge) start on each group as it ends, while the rest generate
        groups = self._group_scorer(raw_prompts, batch["columns"], group_size) if self.stream_scoring else None
        images = batch.get("images")
        if images is not None and not self.engine.takes_images:
            raise ConfigError(f"the prompts have images, which {type(self.engine).__name__} does not take: use the "
                              "Hugging Face engine (model.engine: gspo_lightning.rollout.HFEngine) for a "
                              "vision-language policy")
        start = time.perf_counter()
        self.engine.wake()
        try:
            generation = self.engine.generate(batch["prompt_ids"], group_size, params, seed,
                                              **({"on_group": groups.submit} if groups is not None else {}),
                                              **({"images": images} if images is not None else {}))
        except BaseException:
            if groups is not None:
                groups.cancel()
            raise
        self.engine.sleep()
        timings["time/generate"] = time.perf_counter() - start

        start = time.perf_counter()
        lengths = generation.lengths.tolist()
        completion_ids = [row[:n] for row, n in zip(generation.completion_ids.tolist(), lengths)]
        prompts = [p for p in raw_prompts for _ in range(group_size)]
        if groups is not None:  # what is left: the groups that ended last
            total, components, scored, completions = groups.results()
            errors = sum(self.rewards.error_counts.values()) - groups.errors_before
            scores = (total, components, scored, errors)
        else:
            completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            scores = self._score(prompts, completions, completion_ids, batch, group_size, lengths)
        timings["time/score"] = time.perf_counter() - start

        tensors = build_rollout_tensors(batch["prompt_ids"], generation, group_size, self.tokenizer.pad_token_id, device)
        if images is not None:
            tensors["images"] = [entry for entry in images for _ in range(group_size)]
        return self._rollout(tensors, generation, scores, group_size, prompts, completions, timings, device)

    @property
    def stream_scoring(self) -> bool:
        """Whether groups are scored as they end (an engine that reports them, a reward that waits)."""
        return self.score_while_generating and streams(self.engine, self.rewards)

    def _group_scorer(self, raw_prompts: list, columns: dict, group_size: int) -> GroupScorer:
        if self.reward_loop is None:
            self.reward_loop = RewardLoop()
        decode = lambda ids: self.tokenizer.batch_decode(ids, skip_special_tokens=True)  # noqa: E731
        return GroupScorer(self.rewards, self.reward_loop, decode, list(raw_prompts), columns, group_size,
                           errors_before=sum(self.rewards.error_counts.values()))

    def _score(self, prompts: list, completions: list, completion_ids: list[list[int]], batch: dict, group_size: int,
               completion_lengths: list[int], environments: Optional[list] = None) -> tuple[list, dict, Optional[list], int]:
        """The reward functions on one rollout: ``(totals, components, scored rows or None, errors
        counted)``; the batch's columns repeated for each response of a group (and, for episodes,
        each episode's environment as ``environments``, as TRL's reward functions get them)."""
        columns = {key: [v for v in values for _ in range(group_size)] for key, values in batch["columns"].items()}
        columns["completion_lengths"] = completion_lengths
        if environments is not None:
            if "environments" in columns:
                raise ConfigError("the dataset has a column 'environments', which is the argument reward functions get "
                                  "the episodes' environments in: rename the column")
            columns["environments"] = environments
        errors_before = sum(self.rewards.error_counts.values())
        scored = self.rewards(prompts=prompts, completions=completions, completion_ids=completion_ids, columns=columns)
        scored_rows = scored[2] if len(scored) > 2 else None
        return list(scored[0]), dict(scored[1]), scored_rows, sum(self.rewards.error_counts.values()) - errors_before

    def _rollout(self, tensors: dict, generation: Generation, scores: tuple, group_size: int, prompts: list,
                 completions: list, timings: dict, device: torch.device, **episode_fields) -> Rollout:
        """The :class:`Rollout` of a generation and its scores, tagged with the weights that sampled it."""
        total, components, scored_rows, errors = scores
        return Rollout(
            **tensors,
            rewards=torch.tensor(total, dtype=torch.float32, device=device),
            reward_components={k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in components.items()},
            group_size=group_size,
            policy_version=self.engine.weights_version if generation.weights_version is None else generation.weights_version,
            prompts=prompts,
            completions=completions,
            scored=None if scored_rows is None else torch.tensor(scored_rows, dtype=torch.bool, device=device),
            timings=timings,
            reward_errors=errors,
            reward_stats=self.rewards.pop_failure_counts(len(completions)) if self.rewards is not None else {},
            **episode_fields,
        )

    def _episode_rollout(self, batch: dict, *, seed: int, device: torch.device, evaluation: bool) -> Rollout:
        """Multi-turn episodes: the episode runner drives the engine turn by turn; reward
        functions score whole episodes (TRL's conversational ``completions``), plus the
        environment's turn rewards (component ``environment``)."""
        if batch.get("images") is not None:
            raise ConfigError("multi-turn episodes (model.episodes) render their conversations themselves and do not "
                              "take the data's images column: put a prompt's images in its chat messages, as "
                              "{\"type\": \"image\", \"image\": ...} parts (or have the environment's reset add them)")
        group_size = self.eval_group_size if evaluation else self.group_size
        params = self.eval_params if evaluation else self.train_params
        timings = {}
        start = time.perf_counter()
        self.engine.wake()
        raw_prompts = batch.get("prompts", batch["prompt_text"])
        rows = [dict(zip(batch["columns"], values)) for values in zip(*batch["columns"].values())] or [{} for _ in raw_prompts]
        if self.agents is not None:
            episodes = self.agents.run(self.engine, raw_prompts, rows, group_size, params, seed)
        else:
            episodes = run_episodes(self.episodes, self.engine, raw_prompts, rows, group_size, params, seed)
        self.engine.sleep()
        timings["time/generate"] = time.perf_counter() - start

        start = time.perf_counter()
        generation = episodes.generation
        model_ids = [[t for t, turn in zip(row, turns) if turn >= 0]
                     for row, turns in zip(generation.completion_ids.tolist(), episodes.turn_of_token.tolist())]
        # completion_lengths: the model's tokens, so no length penalty for tool output
        if episodes.agent_rewards is not None:
            total, components, scored_rows, errors = self._score_agent_episodes(episodes, model_ids, batch, group_size)
        elif self.rewards is not None:
            total, components, scored_rows, errors = self._score(
                episodes.prompts, episodes.completions, model_ids, batch, group_size, [len(ids) for ids in model_ids],
                environments=episodes.environments)
        else:  # the environment scores its episodes itself (Environment.scores_episodes)
            total, components, scored_rows, errors = [0.0] * len(model_ids), {}, None, 0
        environment = [sum(rewards) for rewards in episodes.turn_rewards]
        if any(environment):
            total = [t + e for t, e in zip(total, environment)]
            components["environment"] = environment
        for name in sorted({name for rewards in episodes.environment_rewards or [] for name in rewards}):
            # an environment's own named rewards of each episode (TRL's get_reward), weight 1
            values = [rewards.get(name, 0.0) for rewards in episodes.environment_rewards]
            total = [t + v for t, v in zip(total, values)]
            components[name] = values
        timings["time/score"] = time.perf_counter() - start

        lengths = generation.lengths.tolist()
        transcripts = self.tokenizer.batch_decode([row[:n] for row, n in zip(generation.completion_ids.tolist(), lengths)],
                                                  skip_special_tokens=False)
        tensors = build_rollout_tensors(episodes.prompt_ids, generation, 1, self.tokenizer.pad_token_id, device,
                                        loss_mask=episodes.loss_mask)
        if episodes.images is not None:  # each episode's images: its prompt's and its environment's replies'
            tensors["images"] = episodes.images
        return self._rollout(tensors, generation, (total, components, scored_rows, errors), group_size, episodes.prompts,
                             transcripts, timings, device, turn_of_token=episodes.turn_of_token.to(device),
                             turn_rewards=episodes.turn_rewards, episode_stats=episodes.stats)

    def _score_agent_episodes(self, episodes, model_ids: list[list[int]], batch: dict, group_size: int
                              ) -> tuple[list, dict, list, int]:
        """An agent's own reward where it returned one; the reward functions on the episodes it
        returned None for; a failed episode unscored."""
        count = len(model_ids)
        total, scored = [0.0] * count, [False] * count
        components: dict[str, list[float]] = {}
        given = [r is not None and not f for r, f in zip(episodes.agent_rewards, episodes.failed)]
        named = [isinstance(r, dict) and ok for r, ok in zip(episodes.agent_rewards, given)]
        if any(ok and not is_named for ok, is_named in zip(given, named)):
            components["agent"] = [r if ok and not is_named else float("nan")
                                   for r, ok, is_named in zip(episodes.agent_rewards, given, named)]
        # named rewards (a verifiers environment's): each its own component, 0 where an episode lacks it
        for name in sorted({name for r, is_named in zip(episodes.agent_rewards, named) if is_named for name in r}):
            components[name] = [r.get(name, 0.0) if is_named else float("nan")
                                for r, is_named in zip(episodes.agent_rewards, named)]
        for i in (i for i in range(count) if given[i]):
            reward = episodes.agent_rewards[i]
            total[i], scored[i] = (sum(reward.values()) if named[i] else reward), True
        rows = [i for i in range(count) if episodes.agent_rewards[i] is None and not episodes.failed[i]]
        errors = 0
        if rows and self.rewards is not None:
            columns = {key: [v for v in values for _ in range(group_size)] for key, values in batch["columns"].items()}
            columns = {key: [values[i] for i in rows] for key, values in columns.items()}
            pick = lambda values: [values[i] for i in rows]  # noqa: E731
            sub_batch = {"columns": columns}
            sub_total, sub_components, sub_scored, errors = self._score(
                pick(episodes.prompts), pick(episodes.completions), pick(model_ids), sub_batch, 1,
                [len(model_ids[i]) for i in rows])
            for name, values in sub_components.items():
                components[name] = [float("nan")] * count
                for i, value in zip(rows, values):
                    components[name][i] = value
            for k, i in enumerate(rows):
                total[i] = sub_total[k]
                scored[i] = True if sub_scored is None else bool(sub_scored[k])
        return total, components, scored, errors

    def close(self) -> None:
        if self.reward_loop is not None:
            self.reward_loop.close()
            self.reward_loop = None
        if self.started:
            if self.agents is not None:
                self.agents.close()
                self.agents = None
            self.engine.close()
            self.started = False


__all__ = ["Rollout", "RolloutWorker", "build_rollout_tensors"]
