"""Multi-turn episodes: the model acts, the environment answers, until the episode ends.

An episode starts from a row's prompt and the environment's first messages, then alternates
an assistant turn (sampled by any engine from token ids) and the environment's reply, until
the environment says done, ``max_turns`` turns were sampled, or the episode's token budget
(``response_length``: every token after the prompt, the model's and the environment's) is spent.

Token in, token out: the sequence trained on is the prompt's ids, then for each turn exactly
the ids the engine sampled, then the environment's reply rendered once by the chat template
(:class:`~gspo_lightning.episodes.template.ChatRenderer`). Nothing is decoded and encoded
again, so the trainer scores the tokens the engine sampled. The environment's tokens stay in
the sequence (the model conditions on them) and are masked everywhere else: ``loss_mask`` is
True on the model's own tokens only, and the engine log-probs there are 0.

A reply that would overflow the budget is not appended (the episode ends, truncated), so an
episode never holds half a tool result.

The runner sits with the rollout it drives: the settings it runs with (:class:`MultiTurn`),
environments, tools, parsers and the chat renderer are in ``gspo_lightning/episodes/``, which
imports no engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from gspo_lightning.episodes.environments import Environment
from gspo_lightning.episodes.loop import EpisodeLoop
from gspo_lightning.episodes.messages import StepResult
from gspo_lightning.episodes.multi_turn import MultiTurn
from gspo_lightning.errors import ConfigError, EpisodeError
from gspo_lightning.models.vision import ImageInputs, merge_image_inputs, message_images
from gspo_lightning.rollout import stop
from gspo_lightning.rollout.engine import Generation, RolloutEngine, SamplingParams

# how an episode ended
# done: the environment said so (for tools: a turn without a call); max_turns; budget: the episode's
# tokens (response_length) are spent; turn_tokens: a turn reached max_turn_tokens without ending
ENDINGS = ("done", "max_turns", "budget", "turn_tokens", "environment_error")
TRUNCATED = ("budget", "turn_tokens")


@dataclass
class Episode:
    """One episode in progress: the conversation and the token sequence after the prompt."""

    environment: Environment
    messages: list[dict]  # the conversation so far, prompt messages first
    prompt_ids: list[int]
    num_prompt_messages: int
    ids: list[int] = field(default_factory=list)  # the model's and the environment's tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's; 0 on environment tokens
    turn_of_token: list[int] = field(default_factory=list)  # the turn that sampled each token; -1: environment
    turn_rewards: list[float] = field(default_factory=list)  # the environment's reward after each turn
    tool_calls: int = 0
    tool_errors: int = 0
    environment_tokens: int = 0
    ending: Optional[str] = None
    rewards: dict[str, float] = field(default_factory=dict)  # the environment's own, once it ended
    # a vision-language policy's: the image inputs of the prompt's and the replies' images, in order
    images: list[ImageInputs] = field(default_factory=list)

    def image_inputs(self) -> Optional[ImageInputs]:
        """The images of the whole episode so far, as the model takes them (``None``: none)."""
        return merge_image_inputs(self.images)

    @property
    def turns(self) -> int:
        return len(self.turn_rewards)

    def add_model_turn(self, ids: list[int], logprobs: list[float]) -> None:
        turn = self.turns
        self.ids += ids
        self.logprobs += logprobs
        self.turn_of_token += [turn] * len(ids)

    def add_environment(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.turn_of_token += [-1] * len(ids)
        self.environment_tokens += len(ids)

    @property
    def completion_messages(self) -> list[dict]:
        """What follows the prompt, in TRL's conversational form (reward functions get it)."""
        return self.messages[self.num_prompt_messages:]


@dataclass
class EpisodeBatch:
    """The episodes of a rollout, as an engine generation plus what only episodes have."""

    generation: Generation  # completion ids and engine log-probs over all tokens after the prompt
    loss_mask: torch.Tensor  # (N, R) bool: the model's own tokens
    turn_of_token: torch.Tensor  # (N, R) long: the turn of each model token, -1 elsewhere
    prompt_ids: list[list[int]]  # each episode's prompt, as rendered with the tools
    prompts: list[list[dict]]  # each episode's prompt messages
    completions: list[list[dict]]  # each episode's messages after the prompt
    turn_rewards: list[list[float]]
    stats: dict[str, float]
    # agent episodes (rollout/agent/): the reward each agent returned (None: the reward functions
    # score it; a dict: named rewards, summed), and the episodes whose agent failed (unscored)
    agent_rewards: Optional[list[Union[None, float, dict[str, float]]]] = None
    failed: Optional[list[bool]] = None
    # environment episodes: the environments' named rewards of each episode (Environment.rewards),
    # and what reward functions get in environments= (Environment.for_rewards)
    environment_rewards: Optional[list[dict[str, float]]] = None
    environments: Optional[list[Any]] = None
    # each episode's image inputs (None: no episode has an image)
    images: Optional[list[Optional[ImageInputs]]] = None


def as_messages(prompt: Any) -> list[dict]:
    """A row's prompt as chat messages: text becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise TypeError(f"an episode's prompt must be text or chat messages, got {type(prompt).__name__}")


def run_episodes(multi_turn: MultiTurn, engine: RolloutEngine, prompts: list[Any], rows: list[dict], group_size: int,
                 params: SamplingParams, seed: int) -> EpisodeBatch:
    """``group_size`` episodes for each prompt (``rows`` holds each prompt's dataset columns), with
    the environment and limits of ``multi_turn`` (started: :meth:`MultiTurn.start`)."""
    if multi_turn.renderer is None:
        raise RuntimeError("MultiTurn.start(tokenizer) must be called before run_episodes()")
    budget = params.max_new_tokens
    loop = multi_turn.loop
    environments = [multi_turn.environment.fresh() for _ in rows for _ in range(group_size)]  # an episode's own state
    starts = [(dict(row), as_messages(prompt)) for prompt, row in zip(prompts, rows) for _ in range(group_size)]
    conversations = loop.gather(lambda e=e, s=s: e.areset(*s) for e, s in zip(environments, starts))
    failed = next((c for c in conversations if isinstance(c, BaseException)), None)
    if failed is not None:
        raise failed
    episodes = []
    for environment, messages in zip(environments, conversations):
        ids, images = _with_images(multi_turn, multi_turn.renderer.prompt_ids(messages), messages)
        if multi_turn.prompt_length is not None and len(ids) > multi_turn.prompt_length:
            raise ConfigError(f"an episode's prompt is {len(ids)} tokens (the row's prompt with the environment's "
                             f"first messages and the tools' description), more than data.prompt_length="
                             f"{multi_turn.prompt_length}: raise data.prompt_length to at least {len(ids)}")
        episodes.append(Episode(environment, messages, ids, len(messages), images=images))
    groups = [episodes[i:i + group_size] for i in range(0, len(episodes), group_size)]
    # the usual case: every episode of a group starts from the same prompt, sampled as one group
    same_start = all(e.prompt_ids == group[0].prompt_ids for group in groups for e in group)
    group_of = {id(e): index // group_size for index, e in enumerate(episodes)}  # an episode's turns: one server
    versions = []  # the weights version each turn reports (a rollout server's; None: the engine's own)
    # ranks of a sharded policy sampled in place agree on every turn: a rank whose episodes all
    # ended takes the turn on a stand-in prompt, discarded, while another rank still has live ones
    agree = multi_turn.lockstep is not None and engine.shares_policy_weights
    for turn in range(multi_turn.max_turns):
        stop.check()
        live = [e for e in episodes if e.ending is None]
        if agree and multi_turn.lockstep(not live):
            break
        if not agree and not live:
            break
        # in lockstep every rank asks for as many tokens (the decode loop may be a collective
        # too); what a turn samples past an episode's room is cut in _take_turn
        room = budget if agree else max(budget - len(e.ids) for e in live)
        turn_params = dataclasses.replace(params, max_new_tokens=min(room, multi_turn.max_turn_tokens or room))
        turn_seed = seed if turn == 0 else hash_seed(seed, turn)
        if not live:
            engine.generate([episodes[0].prompt_ids], 1, turn_params, turn_seed, **_images_kwarg(engine, episodes[:1]))
            continue
        if turn == 0 and same_start:  # as a single-turn rollout samples its groups
            firsts = [group[0] for group in groups]
            generation = engine.generate([e.prompt_ids for e in firsts], group_size, turn_params, turn_seed,
                                         **_images_kwarg(engine, firsts), **affinity(engine, range(len(firsts))))
        else:
            generation = engine.generate([e.prompt_ids + e.ids for e in live], 1, turn_params, turn_seed,
                                         **_images_kwarg(engine, live),
                                         **affinity(engine, [group_of[id(e)] for e in live]))
        versions.append(generation.weights_version)
        _take_turn(multi_turn, live, generation, budget)
        _finish(loop, [e for e in live if e.ending is not None])
    batch = _batch(multi_turn, episodes, group_size, engine)
    # weights pushed between turns (another rank's push to a shared server) make turns of other
    # versions: the episodes are as old as their oldest turn, as a reply from several servers is
    reported = [v for v in versions if v is not None]
    batch.generation.weights_version = min(reported) if reported else None
    return batch


def _take_turn(multi_turn: MultiTurn, live: list[Episode], generation: Generation, budget: int) -> None:
    lengths = generation.lengths.tolist()
    stepping, cut_turns = [], {}
    for row, episode in enumerate(live):
        room = min(budget - len(episode.ids), multi_turn.max_turn_tokens or budget)
        n = min(lengths[row], room)
        ids = generation.completion_ids[row, :n].tolist()
        cut = bool(generation.truncated[row]) or n < lengths[row]
        episode.add_model_turn(ids, generation.logprobs[row, :n].tolist())
        message = {"role": "assistant", "content": multi_turn.tokenizer.decode(ids, skip_special_tokens=True)}
        episode.messages.append(message)
        if cut and len(episode.ids) >= budget:
            _end(episode, "budget")
            continue
        stepping.append(episode)
        cut_turns[id(episode)] = cut
    results = step_environments(multi_turn.loop, [e.environment for e in stepping], [e.messages[-1] for e in stepping])
    for episode, result in zip(stepping, results):
        if isinstance(result, BaseException):  # user code: reported with the episode's context
            if multi_turn.on_environment_error == "raise" or not isinstance(result, Exception):
                raise EpisodeError(f"the environment {type(episode.environment).__name__} raised in step() at turn "
                                   f"{episode.turns + 1} ({type(result).__name__}: {result}); fix it, or set "
                                   f"model.episodes.on_environment_error=end to end such episodes there") from result
            _end(episode, "environment_error")
            continue
        episode.turn_rewards.append(float(result.reward or 0.0))
        episode.tool_calls += int(result.info.get("tool_calls", 0))
        episode.tool_errors += int(result.info.get("tool_errors", 0))
        if result.done:
            _end(episode, "done", turn_reward=False)
        elif cut_turns[id(episode)]:  # the turn hit max_turn_tokens without ending: what follows would continue mid-turn
            _end(episode, "turn_tokens", turn_reward=False)
        elif episode.turns >= multi_turn.max_turns:
            _end(episode, "max_turns", turn_reward=False)
        else:
            reply, images = _with_images(multi_turn, multi_turn.renderer.continuation_ids(episode.messages, result.messages),
                                         result.messages)
            if len(episode.ids) + len(reply) >= budget:  # no room for the reply and a token of answer
                _end(episode, "budget", turn_reward=False)
                continue
            episode.add_environment(reply)
            episode.images += images
            episode.messages += [dict(m) for m in result.messages]


def _with_images(multi_turn: MultiTurn, ids: list[int], messages: list[dict]) -> tuple[list[int], list[ImageInputs]]:
    """``ids`` rendered from ``messages``, each image placeholder expanded to its image's tokens,
    and the images' inputs (``[]`` for messages without image parts)."""
    images = message_images(messages)
    if not images:
        return ids, []
    if multi_turn.image_renderer is None:
        raise ConfigError(f"an episode's messages hold {len(images)} image(s), but the policy is a text model: "
                          "use a vision-language policy, or reply with text")
    expanded, inputs = multi_turn.image_renderer.expand(ids, images)
    return expanded, [inputs]


def affinity(engine: RolloutEngine, keys) -> dict[str, Any]:
    """``generate``'s ``affinity`` (each prompt's group: its turns go to one server) for an engine
    that takes it."""
    return {"affinity": list(keys)} if engine.takes_affinity else {}


def _images_kwarg(engine: RolloutEngine, episodes: list[Episode]) -> dict[str, Any]:
    """``generate``'s ``images`` for these episodes' sequences (nothing when none has an image)."""
    if not any(e.images for e in episodes):
        return {}
    if not engine.takes_images:
        raise ConfigError(f"an episode has images, which {type(engine).__name__} does not take: use the Hugging Face "
                          "engine (model.engine: gspo_lightning.rollout.HFEngine) for a vision-language policy")
    return {"images": [e.image_inputs() for e in episodes]}


def _end(episode: Episode, ending: str, turn_reward: bool = True) -> None:
    """End ``episode`` (``turn_reward``: its last turn got no environment reply, so it scores 0 there)."""
    if turn_reward:
        episode.turn_rewards.append(0.0)
    episode.ending = ending


def _finish(loop: EpisodeLoop, ended: list[Episode]) -> None:
    """The environments' own rewards of the episodes that just ended (``Environment.afinish``)."""
    for episode, rewards in zip(ended, loop.gather(e.environment.afinish for e in ended)):
        if isinstance(rewards, BaseException):
            raise EpisodeError(f"the environment {type(episode.environment).__name__} raised when its episode ended "
                               f"({type(rewards).__name__}: {rewards})") from rewards
        episode.rewards = {name: float(value) for name, value in rewards.items()}


def step_environments(loop: EpisodeLoop, environments: list[Environment], messages: list[dict]
                      ) -> list[StepResult | BaseException]:
    """``environment.astep(message)`` of every episode at once on the run's loop: what each
    returned, or what it raised."""
    return loop.gather(lambda e=e, m=m: e.astep(m) for e, m in zip(environments, messages))


def _batch(multi_turn: MultiTurn, episodes: list[Episode], group_size: int, engine: RolloutEngine) -> EpisodeBatch:
    pad = multi_turn.tokenizer.pad_token_id if multi_turn.tokenizer.pad_token_id is not None else 0
    truncated = [e.ending in TRUNCATED for e in episodes]
    generation = Generation.from_lists([e.ids or [pad] for e in episodes], [e.logprobs or [0.0] for e in episodes],
                                       truncated, pad)
    generation.lengths = torch.tensor([len(e.ids) for e in episodes], dtype=torch.long)
    width = generation.completion_ids.shape[1]
    turn_of_token = torch.full((len(episodes), width), -1, dtype=torch.long)
    for row, e in enumerate(episodes):
        turn_of_token[row, :len(e.turn_of_token)] = torch.tensor(e.turn_of_token, dtype=torch.long)
    model_tokens = sum(len(e.ids) - e.environment_tokens for e in episodes)
    all_tokens = max(1, sum(len(e.ids) for e in episodes))
    count = len(episodes)
    stats = {
        "episode/turns": sum(e.turns for e in episodes) / count,
        "episode/tool_calls": sum(e.tool_calls for e in episodes) / count,
        "episode/tool_errors": sum(e.tool_errors for e in episodes) / count,
        "episode/environment_token_frac": (all_tokens - model_tokens) / all_tokens if model_tokens else 0.0,
        **{f"episode/ended_{ending}": sum(e.ending == ending for e in episodes) / count for ending in ENDINGS},
    }
    return EpisodeBatch(
        generation=generation, loss_mask=turn_of_token >= 0, turn_of_token=turn_of_token,
        prompt_ids=[e.prompt_ids for e in episodes],
        prompts=[e.messages[:e.num_prompt_messages] for e in episodes],
        completions=[e.completion_messages for e in episodes],
        turn_rewards=[e.turn_rewards for e in episodes], stats=stats,
        environment_rewards=[e.rewards for e in episodes],
        environments=[e.environment.for_rewards() for e in episodes],
        images=[e.image_inputs() for e in episodes] if any(e.images for e in episodes) else None,
    )


def hash_seed(seed: int, turn: int) -> int:
    """A seed per turn, apart from the first turn's (which is the rollout's own seed)."""
    return (seed * 1_000_003 + turn * 7919) % (2**31 - 1)


__all__ = ["ENDINGS", "Episode", "EpisodeBatch", "as_messages", "run_episodes", "step_environments"]
