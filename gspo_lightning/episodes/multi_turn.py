"""Multi-turn episodes' settings (``model.episodes``): the environment, the episode's limits, the
chat renderer built once the tokenizer exists, and GSPO-token's per-turn advantages.

What drives an engine through the turns, the episode runner, sits with the rollout it feeds
(``gspo_lightning/rollout/episodes.py``, :func:`~gspo_lightning.rollout.episodes.run_episodes`):
nothing here imports an engine.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from gspo_lightning._imports import import_callable
from gspo_lightning.episodes.environments import Environment
from gspo_lightning.episodes.factory import FactoryEnvironment
from gspo_lightning.episodes.loop import EpisodeLoop
from gspo_lightning.episodes.parsers import HermesToolCallParser, ToolCallParser
from gspo_lightning.episodes.template import DEFAULT_TOOLS_SYSTEM_PROMPT, ChatRenderer
from gspo_lightning.episodes.verifiers import VERIFIERS_AGENT, VerifiersSettings
from gspo_lightning.errors import ConfigError
from gspo_lightning.models.vision import ImageRenderer
from gspo_lightning.objective.advantages import turn_advantages


class MultiTurn:
    """Multi-turn episodes (``model.episodes``): the environment or the agent, and the episode's limits.

    Args:
        environment: the environment (``class_path``), e.g.
            :class:`~gspo_lightning.episodes.ToolEnvironment` with plain Python functions as
            tools. Each episode gets its own copy (:meth:`Environment.fresh`).
        environment_factory: instead, an environment class written for TRL's
            ``GRPOTrainer(environment_factory=...)`` (its import path), run unchanged: an instance
            per episode, ``reset(**row)``, its public methods as tools read by
            ``tool_call_parser``, ``get_reward()`` and ``environments=`` for reward functions
            (:class:`~gspo_lightning.episodes.FactoryEnvironment`).
        agent: instead of an environment, a user's agent (import path of a function, sync or
            ``async def``) that owns the loop and calls the run's OpenAI-compatible endpoint
            (docs/agents.md). Called once per episode with ``row``, ``base_url``, ``api_key``
            and ``model`` (and ``agent_args``); returns the episode's reward (a float), named rewards
            (``{name: float}``: their sum, each logged as ``reward/<name>``) or None (the reward
            functions score the recorded conversation).
        agent_args: more keyword arguments for every call of the agent (its settings).
        verifiers: instead, a verifiers environment run unchanged (``{id, args, eval_args, harness,
            runtime}``, :class:`~gspo_lightning.episodes.verifiers.VerifiersSettings`): its harness
            calls the run's endpoint, its rewards score the episode; ``data.path: verifiers``
            reads its taskset's rows.
        tool_call_parser: how the endpoint reads tool calls out of sampled text into a reply's
            ``tool_calls``, and writes an assistant message's ``tool_calls`` back as text where the
            chat template cannot render them (default: Hermes ``<tool_call>`` JSON blocks).
        max_concurrent: agent episodes running at once (``null``: the whole rollout batch).
        max_concurrent_tools: tool calls running at once over all episodes of a turn (and threads
            running environments' plain ``step`` methods); each episode's environment steps beside
            the others'.
        agent_timeout_s: an agent still running after this long is an unscored, counted episode.
        endpoint_host: where the endpoint listens (loopback by default; every call needs its
            episode's key wherever it listens).
        endpoint_port: its port (0: a free one, passed to the agent in ``base_url``).
        batch_window_s: how long a call waits for others to join its generation (an agent busy in
            a slow tool does not hold the others back); ``null``: until every running agent's
            call is in, so agents that act alike sample alike in every run (exact resume).
        agent_processes: worker processes the agents run in, many episodes at once in each
            (0: in the trainer's process, on a thread beside the endpoint). The agents' Python
            then runs beside the endpoint and the engine instead of taking turns with them for
            the interpreter lock (docs/agents.md, throughput).
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

    def __init__(self, environment: Optional[Environment] = None, max_turns: int = 4,
                 max_turn_tokens: Optional[int] = None, on_environment_error: str = "raise",
                 turn_advantages: bool = False, turn_discount: float = 1.0,
                 system_prompt_for_tools: Optional[str] = DEFAULT_TOOLS_SYSTEM_PROMPT, end_of_turn: Optional[str] = None,
                 template_kwargs: Optional[dict] = None, agent: Optional[str] = None,
                 tool_call_parser: Optional[ToolCallParser] = None, max_concurrent: Optional[int] = None,
                 agent_timeout_s: float = 300.0, endpoint_host: str = "127.0.0.1", endpoint_port: int = 0,
                 batch_window_s: Optional[float] = 0.05, agent_processes: int = 0,
                 environment_factory: Optional[str] = None, max_concurrent_tools: int = 512,
                 agent_args: Optional[dict] = None, verifiers: Optional[VerifiersSettings] = None):
        given = [name for name, value in (("environment", environment), ("environment_factory", environment_factory),
                                          ("agent", agent), ("verifiers", verifiers)) if value is not None]
        if len(given) != 1:
            raise ConfigError("model.episodes needs exactly one of environment (the runner owns the loop), "
                              "environment_factory (a TRL environment class), agent (your program owns the loop and "
                              "calls the endpoint) and verifiers (a verifiers environment: its harness calls the "
                              f"endpoint); got {' and '.join(given) or 'none'}")
        if agent_args is not None and agent is None:
            raise ConfigError("model.episodes.agent_args are keyword arguments of model.episodes.agent, which is not set")
        if isinstance(verifiers, dict):  # from Python rather than a config
            verifiers = VerifiersSettings(**verifiers)
        self.verifiers = verifiers
        if verifiers is not None:  # an agent episode: verifiers' harness is the agent
            agent, agent_args = VERIFIERS_AGENT, {"verifiers": dataclasses.asdict(verifiers)}
        reserved = sorted(set(agent_args or {}) & {"row", "base_url", "api_key", "model"})
        if reserved:
            raise ConfigError(f"model.episodes.agent_args cannot set {reserved}: the endpoint passes them to each episode")
        self.agent_args = dict(agent_args or {})
        if max_concurrent_tools < 1:
            raise ConfigError(f"model.episodes.max_concurrent_tools must be >= 1, got {max_concurrent_tools}")
        self.max_concurrent_tools = max_concurrent_tools
        self.loop = EpisodeLoop(max_concurrent_tools)  # where the environments' calls run
        if max_concurrent is not None and max_concurrent < 1:
            raise ConfigError(f"model.episodes.max_concurrent must be >= 1 or null (the whole rollout batch), got {max_concurrent}")
        if not agent_timeout_s > 0:
            raise ConfigError(f"model.episodes.agent_timeout_s must be positive, got {agent_timeout_s}")
        if batch_window_s is not None and not batch_window_s >= 0:
            raise ConfigError(f"model.episodes.batch_window_s must be >= 0 or null, got {batch_window_s}")
        if not 0 <= endpoint_port < 65536:
            raise ConfigError(f"model.episodes.endpoint_port must be in 0..65535 (0: a free port), got {endpoint_port}")
        self.agent = agent
        self.agent_function = import_callable(agent, "agent") if agent is not None else None
        self.tool_call_parser = tool_call_parser if tool_call_parser is not None else HermesToolCallParser()
        self.max_concurrent = max_concurrent
        self.agent_timeout_s = agent_timeout_s
        self.endpoint_host = endpoint_host
        self.endpoint_port = endpoint_port
        self.batch_window_s = batch_window_s
        if agent_processes < 0 or (agent_processes and agent is None):
            raise ConfigError(f"model.episodes.agent_processes={agent_processes}: the number of processes the agent runs in "
                              "(0: the trainer's own), with model.episodes.agent set")
        self.agent_processes = agent_processes
        if max_turns < 1:
            raise ConfigError(f"model.episodes.max_turns must be >= 1, got {max_turns}")
        if max_turn_tokens is not None and max_turn_tokens < 1:
            raise ConfigError(f"model.episodes.max_turn_tokens must be >= 1 or null, got {max_turn_tokens}")
        if on_environment_error not in ("raise", "end"):
            raise ConfigError(f"model.episodes.on_environment_error must be raise or end, got {on_environment_error!r}")
        if environment_factory is not None:
            environment = FactoryEnvironment(environment_factory, parser=self.tool_call_parser)
        self.environment = environment
        self.max_turns = max_turns
        self.max_turn_tokens = max_turn_tokens
        self.on_environment_error = on_environment_error
        if not 0 < turn_discount <= 1:
            raise ConfigError(f"model.episodes.turn_discount must be in (0, 1], got {turn_discount}")
        self.turn_advantages = turn_advantages
        self.turn_discount = turn_discount
        self.renderer: Optional[ChatRenderer] = None
        self.image_renderer: Optional[ImageRenderer] = None  # set by start() for a vision-language policy
        self.renderer_options = dict(system_prompt_for_tools=system_prompt_for_tools, end_of_turn=end_of_turn,
                                     template_kwargs=template_kwargs)

    def advantages(self, rewards: torch.Tensor, turn_rewards: list[list[float]], turn_of_token: torch.Tensor,
                   group_size: int, scored: Optional[torch.Tensor]) -> torch.Tensor:
        """GSPO-token's per-turn advantages (``turn_advantages``): ``rewards`` are the episodes'
        totals, the reward functions' outcome plus the environment's turn rewards."""
        outcome = rewards - torch.tensor([sum(r) for r in turn_rewards], dtype=rewards.dtype, device=rewards.device)
        return turn_advantages(outcome, turn_rewards, turn_of_token, group_size, discount=self.turn_discount, scored=scored)

    def start(self, tokenizer, prompt_length: Optional[int] = None, lockstep: Optional[Callable[[bool], bool]] = None,
              image_renderer: Optional[ImageRenderer] = None) -> None:
        """Build the chat renderer (once the tokenizer exists), with the environment's tools.

        ``prompt_length``: the longest prompt the engines were sized for (``data.prompt_length``).
        ``lockstep(done) -> all_done`` (``EngineSpec.lockstep``: a policy sharded over ranks):
        an engine that samples from the sharded policy itself gathers its weights in every
        ``generate``, a collective, so every rank must take as many turns (see
        :func:`~gspo_lightning.rollout.episodes.run_episodes`). ``image_renderer``: a vision-language
        policy's, which renders the images of messages' image parts (an environment that replies
        with an image)."""
        tools = self.environment.tools_schema if self.environment is not None else None
        self.image_renderer = image_renderer
        self.renderer = ChatRenderer(tokenizer, tools, **self.renderer_options)
        self.tokenizer = tokenizer
        self.prompt_length = prompt_length
        self.lockstep = lockstep


def check_episode_objective(episodes: Optional[MultiTurn], importance_sampling: str, adv_estimator: str
                            ) -> Optional[MultiTurn]:
    """``episodes``, checked against the objective: per-turn advantages need token-level
    advantages in the loss."""
    if episodes is not None and episodes.turn_advantages and (importance_sampling == "seq" or adv_estimator != "grpo"):
        raise ConfigError("model.episodes.turn_advantages gives each turn its own advantage: it needs importance_sampling: "
                         f"seq-token (GSPO-token) or token, and adv_estimator: grpo (got {importance_sampling}, "
                         f"{adv_estimator})")
    return episodes


__all__ = ["MultiTurn", "check_episode_objective"]
