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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from gspo_lightning.episodes.environments import Environment
from gspo_lightning.episodes.template import DEFAULT_TOOLS_SYSTEM_PROMPT, ChatRenderer
from gspo_lightning.objective.advantages import turn_advantages
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


def as_messages(prompt: Any) -> list[dict]:
    """A row's prompt as chat messages: text becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise TypeError(f"an episode's prompt must be text or chat messages, got {type(prompt).__name__}")


class MultiTurn:
    """Multi-turn episodes (``model.episodes``): the environment and the episode's limits.

    Args:
        environment: the environment (``class_path``), e.g.
            :class:`~gspo_lightning.episodes.ToolEnvironment` with plain Python functions as
            tools. Each episode gets its own copy (:meth:`Environment.fresh`).
        max_turns: assistant turns per episode at most.
        max_turn_tokens: tokens one assistant turn may sample (``null``: what is left of the
            episode's budget, ``response_length``).
        on_environment_error: ``raise`` stops the run with the episode's context; ``end`` ends
            that episode there (its reward comes from what it did so far) and counts it.
        turn_advantages: GSPO-token's per-turn advantages: each turn's tokens get the return from
            that turn on (the environment's turn rewards, then the episode's reward), against the
            group's mean episode return; needs ``importance_sampling: seq-token`` (or ``token``).
            Off: every token of an episode has the episode's advantage.
        turn_discount: the per-turn discount of those returns (1: none).
        system_prompt_for_tools: how the tools are shown when the chat template has no ``tools``
            section (``{tools}``: their JSON schemas); ``null``: not shown (the prompts show them).
        end_of_turn: the text of the token that ends an assistant turn in the template (default:
            found in the template); ``""`` when the template does not write it (tiny models).
        template_kwargs: extra chat-template variables, e.g. ``{enable_thinking: false}``.
    """

    lockstep: Optional[Callable[[bool], bool]] = None

    def __init__(self, environment: Environment, max_turns: int = 4, max_turn_tokens: Optional[int] = None,
                 on_environment_error: str = "raise", turn_advantages: bool = False, turn_discount: float = 1.0,
                 system_prompt_for_tools: Optional[str] = DEFAULT_TOOLS_SYSTEM_PROMPT, end_of_turn: Optional[str] = None,
                 template_kwargs: Optional[dict] = None):
        if max_turns < 1:
            raise ValueError(f"episodes.max_turns must be >= 1, got {max_turns}")
        if max_turn_tokens is not None and max_turn_tokens < 1:
            raise ValueError(f"episodes.max_turn_tokens must be >= 1 or null, got {max_turn_tokens}")
        if on_environment_error not in ("raise", "end"):
            raise ValueError(f"episodes.on_environment_error must be raise or end, got {on_environment_error!r}")
        self.environment = environment
        self.max_turns = max_turns
        self.max_turn_tokens = max_turn_tokens
        self.on_environment_error = on_environment_error
        if not 0 < turn_discount <= 1:
            raise ValueError(f"episodes.turn_discount must be in (0, 1], got {turn_discount}")
        self.turn_advantages = turn_advantages
        self.turn_discount = turn_discount
        self.renderer: Optional[ChatRenderer] = None
        self.renderer_options = dict(system_prompt_for_tools=system_prompt_for_tools, end_of_turn=end_of_turn,
                                     template_kwargs=template_kwargs)

    def advantages(self, rewards: torch.Tensor, turn_rewards: list[list[float]], turn_of_token: torch.Tensor,
                   group_size: int, scored: Optional[torch.Tensor]) -> torch.Tensor:
        """GSPO-token's per-turn advantages (``turn_advantages``): ``rewards`` are the episodes'
        totals, the reward functions' outcome plus the environment's turn rewards."""
        outcome = rewards - torch.tensor([sum(r) for r in turn_rewards], dtype=rewards.dtype, device=rewards.device)
        return turn_advantages(outcome, turn_rewards, turn_of_token, group_size, discount=self.turn_discount, scored=scored)

    def start(self, tokenizer, prompt_length: Optional[int] = None, lockstep: Optional[Callable[[bool], bool]] = None) -> None:
        """Build the chat renderer (once the tokenizer exists), with the environment's tools.

        ``prompt_length``: the longest prompt the engines were sized for (``data.prompt_length``).
        ``lockstep(done) -> all_done`` (``EngineSpec.lockstep``: a policy sharded over ranks):
        an engine that samples from the sharded policy itself gathers its weights in every
        ``generate``, a collective, so every rank must take as many turns (see :meth:`run`)."""
        self.renderer = ChatRenderer(tokenizer, self.environment.tools_schema, **self.renderer_options)
        self.tokenizer = tokenizer
        self.prompt_length = prompt_length
        self.lockstep = lockstep

    def run(self, engine: RolloutEngine, prompts: list[Any], rows: list[dict], group_size: int,
            params: SamplingParams, seed: int) -> EpisodeBatch:
        """``group_size`` episodes for each prompt (``rows`` holds each prompt's dataset columns)."""
        if self.renderer is None:
            raise RuntimeError("MultiTurn.start(tokenizer) must be called before run()")
        budget = params.max_new_tokens
        episodes = []
        for prompt, row in zip(prompts, rows):
            for _ in range(group_size):
                environment = self.environment.fresh()  # an episode's own state
                messages = environment.reset(dict(row), as_messages(prompt))
                ids = self.renderer.prompt_ids(messages)
                if self.prompt_length is not None and len(ids) > self.prompt_length:
                    raise ValueError(f"an episode's prompt is {len(ids)} tokens (the row's prompt with the environment's "
                                     f"first messages and the tools' description), more than data.prompt_length="
                                     f"{self.prompt_length}: raise data.prompt_length to at least {len(ids)}")
                episodes.append(Episode(environment, messages, ids, len(messages)))
        groups = [episodes[i:i + group_size] for i in range(0, len(episodes), group_size)]
        # the usual case: every episode of a group starts from the same prompt, sampled as one group
        same_start = all(e.prompt_ids == group[0].prompt_ids for group in groups for e in group)
        versions = []  # the weights version each turn reports (a rollout server's; None: the engine's own)
        # ranks of a sharded policy sampled in place agree on every turn: a rank whose episodes all
        # ended takes the turn on a stand-in prompt, discarded, while another rank still has live ones
        agree = self.lockstep is not None and engine.shares_policy_weights
        for turn in range(self.max_turns):
            live = [e for e in episodes if e.ending is None]
            if agree and self.lockstep(not live):
                break
            if not agree and not live:
                break
            # in lockstep every rank asks for as many tokens (the decode loop may be a collective
            # too); what a turn samples past an episode's room is cut in _take_turn
            room = budget if agree else max(budget - len(e.ids) for e in live)
            turn_params = dataclasses.replace(params, max_new_tokens=min(room, self.max_turn_tokens or room))
            turn_seed = seed if turn == 0 else hash_seed(seed, turn)
            if not live:
                engine.generate([episodes[0].prompt_ids], 1, turn_params, turn_seed)
                continue
            if turn == 0 and same_start:  # as a single-turn rollout samples its groups
                generation = engine.generate([group[0].prompt_ids for group in groups], group_size, turn_params, turn_seed)
            else:
                generation = engine.generate([e.prompt_ids + e.ids for e in live], 1, turn_params, turn_seed)
            versions.append(generation.weights_version)
            self._take_turn(live, generation, budget)
        batch = self._batch(episodes, group_size, engine)
        # weights pushed between turns (another rank's push to a shared server) make turns of other
        # versions: the episodes are as old as their oldest turn, as a reply from several servers is
        reported = [v for v in versions if v is not None]
        batch.generation.weights_version = min(reported) if reported else None
        return batch

    def _take_turn(self, live: list[Episode], generation: Generation, budget: int) -> None:
        lengths = generation.lengths.tolist()
        for row, episode in enumerate(live):
            room = min(budget - len(episode.ids), self.max_turn_tokens or budget)
            n = min(lengths[row], room)
            ids = generation.completion_ids[row, :n].tolist()
            cut = bool(generation.truncated[row]) or n < lengths[row]
            episode.add_model_turn(ids, generation.logprobs[row, :n].tolist())
            message = {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}
            episode.messages.append(message)
            if cut and len(episode.ids) >= budget:
                episode.turn_rewards.append(0.0)
                episode.ending = "budget"
                continue
            try:
                result = episode.environment.step(message)
            except Exception as err:  # noqa: BLE001 - user code: reported with the episode's context
                if self.on_environment_error == "raise":
                    raise RuntimeError(f"the environment {type(episode.environment).__name__} raised in step() at turn "
                                       f"{episode.turns + 1} ({type(err).__name__}: {err}); fix it, or set "
                                       f"model.episodes.on_environment_error=end to end such episodes there") from err
                episode.turn_rewards.append(0.0)
                episode.ending = "environment_error"
                continue
            episode.turn_rewards.append(float(result.reward or 0.0))
            episode.tool_calls += int(result.info.get("tool_calls", 0))
            episode.tool_errors += int(result.info.get("tool_errors", 0))
            if result.done:
                episode.ending = "done"
                continue
            if cut:  # the turn hit max_turn_tokens without ending: what follows would continue mid-turn
                episode.ending = "turn_tokens"
                continue
            if episode.turns >= self.max_turns:
                episode.ending = "max_turns"
                continue
            reply = self.renderer.continuation_ids(episode.messages, result.messages)
            if len(episode.ids) + len(reply) >= budget:  # no room for the reply and a token of answer
                episode.ending = "budget"
                continue
            episode.add_environment(reply)
            episode.messages += [dict(m) for m in result.messages]

    def _batch(self, episodes: list[Episode], group_size: int, engine: RolloutEngine) -> EpisodeBatch:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
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
        )


def check_episode_objective(episodes: Optional[MultiTurn], importance_sampling: str, adv_estimator: str
                            ) -> Optional[MultiTurn]:
    """``episodes``, checked against the objective: per-turn advantages need token-level
    advantages in the loss."""
    if episodes is not None and episodes.turn_advantages and (importance_sampling == "seq" or adv_estimator != "grpo"):
        raise ValueError("episodes.turn_advantages gives each turn its own advantage: it needs importance_sampling: "
                         f"seq-token (GSPO-token) or token, and adv_estimator: grpo (got {importance_sampling}, "
                         f"{adv_estimator})")
    return episodes


def hash_seed(seed: int, turn: int) -> int:
    """A seed per turn, apart from the first turn's (which is the rollout's own seed)."""
    return (seed * 1_000_003 + turn * 7919) % (2**31 - 1)


__all__ = ["ENDINGS", "Episode", "EpisodeBatch", "MultiTurn", "as_messages", "check_episode_objective"]
