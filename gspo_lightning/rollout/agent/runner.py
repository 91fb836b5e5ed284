"""Agent episodes: a user's agent owns the loop and calls the endpoint; the rollout thread
samples the calls in batches with the run's engine; the record becomes the step's episodes.

Three threads meet here: the rollout thread (this module's :meth:`AgentRunner.run`, the only
one that touches the engine), the endpoint's event loop (HTTP, rendering, recording), and the
agents' event loop (``async def`` agents run on it; plain functions in a thread pool beside
it, so an agent that blocks holds only its own thread). With ``episodes.agent_processes`` the
agents run in worker processes instead (``processes.py``) and this loop only waits for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

import torch

from gspo_lightning.episodes.multi_turn import MultiTurn
from gspo_lightning.errors import AgentError, ConfigError
from gspo_lightning.rewards.base import is_async_callable
from gspo_lightning.rollout import stop
from gspo_lightning.rollout.agent.endpoint import AgentEndpoint, TurnLimits
from gspo_lightning.rollout.agent.processes import AgentFailed, AgentProcesses, check_result, quiet_about_open_clients
from gspo_lightning.rollout.agent.record import AgentSession
from gspo_lightning.rollout.engine import Generation, RolloutEngine, SamplingParams
from gspo_lightning.rollout.episodes import EpisodeBatch, affinity, as_messages
from gspo_lightning.rollout.sampling import mix_seed

FAILURES = ("error", "timeout", "no_calls")


@dataclasses.dataclass
class Outcome:
    """How one agent episode ended: its reward (None: the reward functions score it; named
    rewards: their sum, each logged) or its failure."""

    reward: Union[None, float, dict[str, float]] = None
    failure: Optional[str] = None  # error | timeout | no_calls
    message: str = ""


class AgentRunner:
    """The endpoint and the agents of a run's agent episodes (``model.episodes.agent``).

    Args:
        multi_turn: the episodes' settings, started (``MultiTurn.start``).
        model_name: the name the endpoint serves the policy under (the agent's ``model``).
        local_rank: this process's rank on its machine: a fixed ``endpoint_port`` is shifted by
            it, so each rank serves its own episodes on its own port.
    """

    def __init__(self, multi_turn: MultiTurn, model_name: str, local_rank: int = 0):
        if multi_turn.agent_function is None:
            raise ConfigError("AgentRunner needs model.episodes.agent")
        self.multi_turn = multi_turn
        self.model_name = model_name
        self.endpoint = AgentEndpoint(multi_turn.tokenizer, multi_turn.tool_call_parser, multi_turn.renderer_options,
                                      model_name, host=multi_turn.endpoint_host,
                                      port=multi_turn.endpoint_port + local_rank if multi_turn.endpoint_port else 0,
                                      window_s=multi_turn.batch_window_s)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._printed: set[str] = set()
        self.processes = AgentProcesses(multi_turn.agent, multi_turn.agent_processes) \
            if multi_turn.agent_processes else None

    def start(self) -> None:
        if self.processes is not None:
            self.processes.start()  # again each rollout: a worker that died is replaced
        if self._thread is not None:
            return
        self.endpoint.start()
        self._loop = asyncio.new_event_loop()
        quiet_about_open_clients(self._loop)
        self._thread = threading.Thread(target=self._loop.run_forever, name="gspo-agents", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self.processes is not None:
            self.processes.close()
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._thread = None
        self.endpoint.stop()

    # -- one rollout ---------------------------------------------------------------------------
    def run(self, engine: RolloutEngine, prompts: list[Any], rows: list[dict], group_size: int, params: SamplingParams,
            seed: int) -> EpisodeBatch:
        """``group_size`` agent episodes per prompt (``rows``: each prompt's dataset columns)."""
        self.start()
        multi_turn = self.multi_turn
        sessions = [AgentSession(index * group_size + k, dict(row))
                    for index, row in enumerate(rows) for k in range(group_size)]
        limits = TurnLimits(temperature=params.temperature, top_p=params.top_p, response_length=params.max_new_tokens,
                            prompt_length=multi_turn.prompt_length, max_turn_tokens=multi_turn.max_turn_tokens)
        outcomes = [Outcome() for _ in sessions]
        self.endpoint.open_episodes(sessions, limits, multi_turn.max_concurrent)
        agents = asyncio.run_coroutine_threadsafe(self._run_agents(sessions, outcomes), self._loop)
        try:
            versions = self._sample_calls(engine, params, seed, group_size)
        except BaseException:
            agents.cancel()
            # calls still waiting for a generation get an error reply now: none will come (a stop,
            # a failed engine), and the endpoint's shutdown waits for its open requests
            self.endpoint.queue.fail_pending(RuntimeError("the rollout ended before this call was sampled"))
            raise
        finally:
            self.endpoint.close_episodes()
        agents.result()
        batch = self._batch(sessions, outcomes, prompts, group_size)
        if self.endpoint.queue.stalls and "stalls" not in self._printed:
            self._printed.add("stalls")
            print(f"agent episodes: with batch_window_s null a batch waited over {self.endpoint.queue.stall_s:g} s for "
                  "an agent's call and was taken "
                  "without it (sampling is then not reproducible): the agent's client holds fewer connections than "
                  "episodes run at once; raise its pool (httpx Limits) or lower model.episodes.max_concurrent (said once)",
                  file=sys.stderr, flush=True)
        reported = [v for v in versions if v is not None]
        batch.generation.weights_version = min(reported) if reported else None
        self._report_failures(outcomes)
        return batch

    async def _run_agents(self, sessions: list[AgentSession], outcomes: list[Outcome]) -> None:
        multi_turn = self.multi_turn
        agent = multi_turn.agent_function
        limit = multi_turn.max_concurrent or len(sessions)
        gate = asyncio.Semaphore(limit)
        in_process = self.processes is None
        pool = None if not in_process or is_async_callable(agent) else ThreadPoolExecutor(
            max_workers=min(limit, len(sessions)), thread_name_prefix="gspo-agent")
        loop = asyncio.get_running_loop()

        async def one(session: AgentSession, outcome: Outcome) -> None:
            async with gate:
                try:
                    kwargs = dict(row=dict(session.row), base_url=self.endpoint.base_url, api_key=session.key,
                                  model=self.model_name, **multi_turn.agent_args)
                    if not in_process:  # the worker times the episode; a worker stuck in C code is still bounded here
                        outcome.reward = await asyncio.wait_for(self.processes.run(kwargs, multi_turn.agent_timeout_s),
                                                                multi_turn.agent_timeout_s + 10)
                    else:
                        work = agent(**kwargs) if pool is None else loop.run_in_executor(pool, functools.partial(agent, **kwargs))
                        outcome.reward = check_result(await asyncio.wait_for(work, multi_turn.agent_timeout_s))
                    if session.calls == 0:
                        outcome.failure, outcome.message = "no_calls", "the agent returned without calling the endpoint"
                except asyncio.TimeoutError:
                    outcome.failure = "timeout"
                    outcome.message = f"the agent ran past model.episodes.agent_timeout_s={multi_turn.agent_timeout_s:g}"
                except AgentFailed as err:  # raised in a worker process: its last traceback line
                    outcome.failure, outcome.message = "error", str(err)
                except Exception as err:  # noqa: BLE001 - user code: an unscored episode, counted and shown
                    outcome.failure = "error"
                    outcome.message = traceback.format_exception_only(type(err), err)[-1].strip()
                finally:
                    self.endpoint.end_episode(session)

        try:
            await asyncio.gather(*(one(s, o) for s, o in zip(sessions, outcomes)))
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)  # an agent past its timeout keeps only its thread

    def _sample_calls(self, engine: RolloutEngine, params: SamplingParams, seed: int, group_size: int
                      ) -> list[Optional[int]]:
        """Generate for the calls in batches until every agent ended; the versions that sampled."""
        queue = self.endpoint.queue
        lockstep = self.multi_turn.lockstep if engine.shares_policy_weights else None
        pad = self.multi_turn.tokenizer.pad_token_id or 0
        turn_cap = min(params.max_new_tokens, self.multi_turn.max_turn_tokens or params.max_new_tokens)
        versions, batches = [], 0
        while True:
            stop.check()  # the agents are cancelled on the way out (run)
            # ranks of a sharded policy sampled in place generate together (see run_episodes)
            if (lockstep(queue.done) if lockstep is not None else queue.done):
                break
            calls = queue.take()
            if (lockstep(not calls) if lockstep is not None else not calls):
                continue
            room = turn_cap if lockstep is not None else max(c.max_new_tokens for c in calls)
            turn_params = dataclasses.replace(params, max_new_tokens=room)
            prompts = [c.prompt_ids for c in calls] or [[pad]]
            try:
                # an episode's calls go to its group's server (prefix cache), for engines with several
                generation = engine.generate(prompts, 1, turn_params, seed if batches == 0 else mix_seed(seed, batches, 7919),
                                             **affinity(engine, [c.episode // group_size for c in calls] or [0]))
            except BaseException as err:
                failure = RuntimeError(f"the engine failed: {type(err).__name__}: {err}")
                for call in calls:
                    call.resolve(error=failure)
                queue.fail_pending(failure)
                raise
            batches += 1
            versions.append(generation.weights_version if generation.weights_version is not None
                            else engine.weights_version)
            lengths = generation.lengths.tolist()
            for row, call in enumerate(calls):
                n = lengths[row]
                call.resolve((generation.completion_ids[row, :n].tolist(), generation.logprobs[row, :n].tolist(),
                              bool(generation.truncated[row]), versions[-1]))
        return versions

    # -- the record as a batch -----------------------------------------------------------------
    def _batch(self, sessions: list[AgentSession], outcomes: list[Outcome], prompts: list[Any], group_size: int
               ) -> EpisodeBatch:
        tokenizer = self.multi_turn.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        rows_ids, rows_logprobs, rows_turns, prompt_ids, prompt_messages, completions, truncated = [], [], [], [], [], [], []
        for session in sessions:
            segment = session.segment
            if segment is None:  # never called: a row of one pad token, unscored
                messages = as_messages(prompts[session.index // group_size])
                prompt_ids.append(self.multi_turn.renderer.prompt_ids(messages))
                prompt_messages.append(messages)
                completions.append([])
                rows_ids.append([]), rows_logprobs.append([]), rows_turns.append([])
                truncated.append(False)
                continue
            prompt_ids.append(segment.prompt_ids)
            prompt_messages.append(segment.messages[:segment.num_prompt_messages])
            completions.append(segment.messages[segment.num_prompt_messages:])
            rows_ids.append(segment.ids), rows_logprobs.append(segment.logprobs), rows_turns.append(segment.turn_of_token)
            truncated.append(session.budget_spent or not segment.last_turn_closed)
        generation = Generation.from_lists([ids or [pad] for ids in rows_ids], [lps or [0.0] for lps in rows_logprobs],
                                           truncated, pad)
        generation.lengths = torch.tensor([len(ids) for ids in rows_ids], dtype=torch.long)
        turn_of_token = torch.full(generation.completion_ids.shape, -1, dtype=torch.long)
        for row, turns in enumerate(rows_turns):
            turn_of_token[row, :len(turns)] = torch.tensor(turns, dtype=torch.long)
        count = len(sessions)
        all_tokens = max(1, sum(len(ids) for ids in rows_ids))
        environment_tokens = sum(t < 0 for turns in rows_turns for t in turns)
        failures = {kind: sum(o.failure == kind for o in outcomes) for kind in FAILURES}
        stats = {
            "agent/calls": float(sum(s.calls for s in sessions)),
            "agent/forks": float(sum(s.forks for s in sessions)),
            "agent/errors": float(failures["error"] + failures["no_calls"]),
            "agent/timeouts": float(failures["timeout"]),
            "episode/turns": sum(s.segment.turns if s.segment else 0 for s in sessions) / count,
            "episode/tool_calls": sum(s.tool_calls for s in sessions) / count,
            "episode/environment_token_frac": environment_tokens / all_tokens,
            "episode/ended_budget": sum(s.budget_spent for s in sessions) / count,
        }
        return EpisodeBatch(
            generation=generation, loss_mask=turn_of_token >= 0, turn_of_token=turn_of_token, prompt_ids=prompt_ids,
            prompts=prompt_messages, completions=completions,
            turn_rewards=[[0.0] * (s.segment.turns if s.segment else 0) for s in sessions], stats=stats,
            agent_rewards=[o.reward for o in outcomes], failed=[o.failure is not None for o in outcomes],
        )

    def _report_failures(self, outcomes: list[Outcome]) -> None:
        failed = [o for o in outcomes if o.failure is not None]
        if not failed:
            return
        last = failed[-1]
        counts = ", ".join(f"{sum(o.failure == kind for o in failed)} {what}" for kind, what in
                           (("error", "raised"), ("timeout", "timed out"), ("no_calls", "never called the endpoint"))
                           if any(o.failure == kind for o in failed))
        line = f"{len(failed)} of {len(outcomes)} agent episodes failed ({counts}; unscored); the last: {last.message}"
        if 2 * len(failed) > len(outcomes):
            raise AgentError(f"{line}. More than half of the step's episodes failed: fix the agent (or raise "
                             "model.episodes.agent_timeout_s), then resume")
        if last.message not in self._printed:  # each distinct failure once, not once per step
            self._printed.add(last.message)
            print(f"agent episodes: {line}", file=sys.stderr, flush=True)


__all__ = ["AgentRunner", "Outcome"]
