"""``GSPOModule``: the policy, its frozen reference, and one GSPO step.

One ``training_step`` turns a batch of prompts into updates:

1. rollout, from the rollout source ``max_staleness`` chose (``rollout/source.py``): sampled
   now with the current weights (``0``), or generated ahead on a producer thread (``k >= 1``)
2. log-prob passes needed before any update (old policy, reference), no grad; the off-policy
   weights (``objective/offpolicy.py``) and the clip budget's split (``objective/clip_budget.py``)
3. rewards -> advantages (``objective/advantages.py``)
4. the updates: ``ppo_epochs`` x mini-batches x micro-batches (``training/update.py``), every optimizer
   call through the strategy (``training/strategy_ops.py``)
5. metrics -> loggers

Three counters, one meaning each (docs/architecture.md, "Counters"): ``policy_version``
(optimizer steps taken: the weights' version), ``rollout_steps`` (rollout batches trained on)
and Lightning's ``trainer.global_step`` (rollout steps that took an optimizer step).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import time
import warnings
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from gspo_lightning.episodes.multi_turn import MultiTurn, check_episode_objective
from gspo_lightning.errors import ConfigError, NonFiniteError
from gspo_lightning.models.cpu_attention import group_attention_on_cpu
from gspo_lightning.models.gguf import resolve_model
from gspo_lightning.models.loading import eos_token_ids, load_policy, load_tokenizer
from gspo_lightning.models.lora import LoRA, adapters_disabled, attach_lora
from gspo_lightning.models.vision import freeze_vision_tower, is_vision_language, share_vision_tower
from gspo_lightning.models.settings import Policy
from gspo_lightning.objective.advantages import Advantages, RunningMoments
from gspo_lightning.objective.clip_budget import ClipBudget
from gspo_lightning.objective.offpolicy import importance_weights
from gspo_lightning.objective.passk import Evaluation, record_eval_rollout
from gspo_lightning.objective.settings import Objective
from gspo_lightning.rewards.base import RewardComposer, RewardSpec
from gspo_lightning.rollout import EngineSpec, HFEngine, Rollout, RolloutEngine, RolloutWorker
from gspo_lightning.rollout.sampling import step_seed
from gspo_lightning.rollout.settings import Asynchronous, RolloutSettings
from gspo_lightning.rollout.source import RolloutSource, rollout_source
from gspo_lightning.rollout.weight_sync import engine_weights
from gspo_lightning.rollout.phases import PHASES
from gspo_lightning.training import log_fast_path
from gspo_lightning.training.distributed import GradientSync, all_ranks_true, all_reduce_sum, check_strategy
from gspo_lightning.training.logprobs import response_logprobs
from gspo_lightning.training.loss_scaling import LossScaling
from gspo_lightning.training.metrics import ConstantRewardWatch, StepMetrics, eval_step, step_values
from gspo_lightning.training.checkpointing import CheckpointHooks
from gspo_lightning.training.rank_state import gather_objects
from gspo_lightning.training.strategy_ops import StrategyOps
from gspo_lightning.training.config import ModuleSettings, rename_note, with_flat_keys
from gspo_lightning.training.update import MetricHook, PolicyUpdater, Update, update_settings

__all__ = ["GSPOModule", "NonFiniteError"]


class GSPOModule(CheckpointHooks, L.LightningModule):
    """GSPO (and GRPO-family) training of a causal language model.

    The knobs live in typed blocks, each documented with its fields (``gspo fit --help``,
    docs/config.md): ``policy`` (``models/settings.py``), ``rollout`` and ``asynchronous``
    (``rollout/settings.py``), ``evaluation`` (``objective/passk.py``), ``advantages``
    (``objective/advantages.py``), ``objective`` (``objective/settings.py``) and ``update``
    (``training/update.py``). The flat keys of earlier releases (``clip_low``, ``response_length``,
    ROLL's keys...) are still accepted as keyword arguments with the same meaning
    (``training/config.py``).

    Args:
        model_name_or_path: hub id, local folder, a ``.gguf`` file, or ``builtin:<name>`` (a tiny
            local model, or ``builtin:smollm2-135m-instruct``); GGUF is converted once into a
            cached folder (``models/gguf.py``).
        policy: how the policy is loaded: dtype, attention implementation, gradient checkpointing,
            remote code, GGUF file.
        lora: train LoRA adapters on the frozen policy (``models/lora.py``: rank, alpha, dropout,
            target modules); the reference is then the base with the adapters off. ``null``: full weights.
        rewards: the reward functions (import path, weight, kwargs, name).
        engine: the generation engine, by ``class_path`` (default: ``HFEngine``, the policy
            itself; ``gspo_lightning.rollout.VLLMEngine`` for vLLM, see docs/vllm.md;
            ``gspo_lightning.rollout.RemoteEngine`` for rollout servers, docs/scaling.md).
        episodes: multi-turn episodes with an environment or your own agent (``episodes.MultiTurn``; docs/episodes.md, docs/agents.md): each
            sample is an episode, ``rollout.response_length`` its token budget after the prompt. ``null``: one turn.
        rollout: each step's rollout: group size, lengths, sampling, seed, dynamic sampling, reward errors.
        evaluation: held-out evaluation: samples per prompt, temperature, accuracy threshold.
        advantages: rewards to advantages: estimator, normalization, clips, token-level KL.
        objective: the policy loss: ratio level, per-unit objective (``policy_loss``), aggregation,
            old log-probs, KL loss.
        update: the updates: epochs, mini- and micro-batches, gradient clip, filters, MoE, metric hooks.
        asynchronous: rollouts generated ahead (``max_staleness``), off-policy correction, clip budget.
        export_on_fit_end: save the policy with ``save_pretrained`` (safetensors + tokenizer)
            to ``<log dir>/hf_model`` when ``fit`` ends (done by the run's ``ExportOnFitEnd`` callback: the
            ``gspo`` command attaches it; a script building its own ``Trainer`` calls
            ``gspo_lightning.run.attach_run_callbacks(trainer)``).
        optimizer: optimizer factory (default AdamW, lr 1e-6).
        lr_scheduler: scheduler factory, stepped once per optimizer step.
    """

    def __init__(
        self,
        model_name_or_path: str = "builtin:tiny-echo",
        policy: Policy = Policy(),  # noqa: B008 - a block of defaults, never mutated
        lora: Optional[LoRA] = None,
        rewards: Optional[list[RewardSpec]] = None,
        engine: Optional[RolloutEngine] = None,
        episodes: Optional[MultiTurn] = None,
        rollout: RolloutSettings = RolloutSettings(),  # noqa: B008 - a block of defaults, never mutated
        evaluation: Evaluation = Evaluation(),  # noqa: B008 - a block of defaults, never mutated
        advantages: Advantages = Advantages(),  # noqa: B008 - a block of defaults, never mutated
        objective: Objective = Objective(),  # noqa: B008 - a block of defaults, never mutated
        update: Update = Update(),  # noqa: B008 - a block of defaults, never mutated
        asynchronous: Asynchronous = Asynchronous(),  # noqa: B008 - a block of defaults, never mutated
        export_on_fit_end: bool = True,
        optimizer: Optional[OptimizerCallable] = None,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
        **flat_keys,
    ):
        super().__init__()
        blocks = dict(policy=policy, rollout=rollout, evaluation=evaluation, advantages=advantages, objective=objective,
                      update=update, asynchronous=asynchronous)
        if flat_keys:  # the flat keys of earlier releases (and of their checkpoints' hyper-parameters)
            blocks, renames = with_flat_keys(blocks, flat_keys)
            rank_zero_info(rename_note(renames))
        # the blocks, checked together (training/config.py); read as self.settings.<block>.<field>
        self.settings = ModuleSettings.build(**blocks)
        self.lora = LoRA(**lora) if isinstance(lora, dict) else lora
        # plain values, so checkpoints load with torch.load(weights_only=True) and rebuild this module
        self.save_hyperparameters({
            "model_name_or_path": model_name_or_path, "export_on_fit_end": export_on_fit_end,
            "rewards": [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in rewards or []] or None,
            "lora": dataclasses.asdict(self.lora) if self.lora is not None else None,
            **self.settings.plain_values(),
        })
        self.export_on_fit_end = export_on_fit_end
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        cfg = self.settings
        self.off_policy = cfg.asynchronous.off_policy
        self.clip_budget = ClipBudget(cfg.objective.importance_sampling, cfg.objective.policy_loss) \
            if cfg.asynchronous.clip_budget else None
        self.metric_hooks: list[MetricHook] = list(cfg.update.metric_hooks or []) + \
            ([self.clip_budget] if self.clip_budget is not None else [])
        self.automatic_optimization = False
        log_fast_path.install()  # ~40 metrics a step through self.log: Lightning's per-key walk is 13 ms of it

        # the folder every loader reads: a GGUF source's converted copy, else the name itself
        self.model_source = resolve_model(model_name_or_path, cfg.policy.gguf_file)
        self.tokenizer = load_tokenizer(self.model_source, cfg.policy.trust_remote_code)
        r = cfg.rollout
        composer = RewardComposer(self.hparams["rewards"], on_error=r.on_reward_error) if rewards else None
        self.worker = RolloutWorker(
            engine if engine is not None else HFEngine(), composer, self.tokenizer,
            train_params=r.params, group_size=r.num_return_sequences_in_group,
            eval_params=r.eval_params(cfg.evaluation.val_temperature), eval_group_size=cfg.evaluation.val_num_samples,
            episodes=episodes, score_while_generating=r.score_while_generating,
        )
        self.episodes = check_episode_objective(episodes, cfg.objective.importance_sampling, cfg.advantages.adv_estimator)
        self.policy = None
        self.reference = None
        self.routing_recorder = None  # MoE policies: gspo_lightning.models.moe.RoutingRecorder (experts chosen per token)
        self.running_rewards = RunningMoments()
        # "rollout" or "update" while a step runs, "evaluation" during one, else None (run/preemption.py
        # reads it: a stop abandons a rollout or an evaluation at once, lets an update finish, and a
        # failure's checkpoint waits for the update)
        self.step_phase: Optional[str] = None
        self.step_metrics = StepMetrics()
        self.constant_rewards = ConstantRewardWatch()
        self.val_metrics = StepMetrics()
        self.updater: Optional[PolicyUpdater] = None
        self.policy_version = 0  # optimizer steps taken; the weights a rollout was sampled with
        self.rollout_steps = 0  # rollout batches trained on
        self.grad_sync = GradientSync()
        self.sharded = False  # parameters split over ranks (FSDP2)
        self._chunked_logprobs = True  # the decoder and the head may be called separately
        self._updater_state: dict[str, int] = {}
        self.rollouts: Optional[RolloutSource] = None  # where training rollouts come from (rollout/source.py)
        self._pending_rollouts: Optional[dict] = None  # from a checkpoint, for the rollout source
        self._trained_this_fit = False

    # -- models ------------------------------------------------------------------------
    @property
    def needs_reference(self) -> bool:
        return self.settings.objective.use_kl_loss or self.settings.advantages.add_token_level_kl

    def configure_model(self) -> None:
        """Load the policy (and the reference, when a KL term needs it) once."""
        if self.policy is not None:
            return
        cfg = self.settings
        policy = load_policy(self.model_source, self.tokenizer, cfg.policy.dtype, cfg.policy.attn_implementation, cfg.policy.trust_remote_code)
        frozen_tower = is_vision_language(policy) and cfg.policy.freeze_vision
        if is_vision_language(policy) and not cfg.policy.freeze_vision and self.lora is not None:
            raise ConfigError("model.policy.freeze_vision: false trains the vision tower's weights, but with model.lora "
                              "only adapters train (on the language model): remove one of the two")
        if frozen_tower:
            freeze_vision_tower(policy)
        policy = attach_lora(policy, self.lora) if self.lora is not None else policy
        # from_pretrained returns eval mode, and neither Lightning nor transformers switch back:
        # gradient checkpointing and dropout act only in train mode
        self.policy = policy.train()
        if cfg.policy.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.policy.config.use_cache = False
        if self.needs_reference and self.lora is None:  # with LoRA the reference is the base: adapters off
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
            if frozen_tower and self.device_mesh is None:  # (sharded, each model keeps its own shards)
                share_vision_tower(self.policy, self.reference)
        if self.device_mesh is not None:  # set by ModelParallelStrategy (FSDP2)
            self._fully_shard(self.device_mesh)
        config = self.policy.config
        if cfg.update.routing_replay or cfg.update.router_aux_loss_coef > 0 or getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0):
            from gspo_lightning.models.moe import RoutingRecorder

            self.routing_recorder = RoutingRecorder(self.policy)

    def _fully_shard(self, mesh) -> None:
        """FSDP2: the policy and the frozen reference, sharded alike (``training/sharding.py``)."""
        from gspo_lightning.training.sharding import data_parallel_mesh, fully_shard_causal_lm

        dp_mesh = data_parallel_mesh(mesh)
        self._chunked_logprobs = fully_shard_causal_lm(self.policy, dp_mesh)
        if self.reference is not None:
            fully_shard_causal_lm(self.reference, dp_mesh)
        self.sharded = True

    def configure_optimizers(self):
        self.configure_model()
        params = [p for p in self.policy.parameters() if p.requires_grad]
        try:  # torch checks the values itself, in its own words ("Invalid learning rate: -0.001"): name the key
            optimizer = self.optimizer_factory(params) if self.optimizer_factory else torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model.optimizer: {err}; change it in model.optimizer.init_args") from err
        if self.scheduler_factory is None:
            return optimizer
        try:
            scheduler = self.scheduler_factory(optimizer)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model.lr_scheduler: {err}; change it in model.lr_scheduler.init_args") from err
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- the run's lifecycle -----------------------------------------------------------
    def setup(self, stage: str) -> None:
        check_strategy(self.trainer.strategy)
        self.configure_model()
        group_attention_on_cpu(self.trainer.strategy.root_device)  # no key/value copies per query head
        rewards_itself = self.episodes is not None and (self.episodes.agent is not None or (
            self.episodes.environment is not None and self.episodes.environment.scores_episodes))
        if self.worker.rewards is None and not rewards_itself:
            raise ConfigError("no reward functions configured: set model.rewards, e.g. "
                             "[{function: gspo_lightning.rewards.math_accuracy}] (an agent that returns rewards, or "
                             "an environment that scores its episodes, e.g. a TRL class with get_reward, needs none)")

    def on_fit_start(self) -> None:
        self.grad_sync = GradientSync.for_strategy(self.trainer.strategy, self.trainer.world_size, self.policy, self._logprobs)
        if self.settings.rollout.rollout_batch_size is not None:  # sizes that do not divide fail now, not after a rollout
            self._build_updater(self.settings.rollout.rollout_batch_size, self.trainer.world_size)
        self._start_worker()
        self.rollouts = self._rollout_source(self.settings.asynchronous.max_staleness, fit=True)

    def _rollout_source(self, max_staleness: int, fit: bool) -> RolloutSource:
        cfg = self.settings
        source = rollout_source(
            self.worker, lambda: engine_weights(self.policy, self.worker.engine.weights_format), self.device, self.sampling_seed,
            max_staleness=max_staleness, stale_rollouts=cfg.asynchronous.stale_rollouts, datamodule=self.trainer.datamodule,
            dynamic_sampling_rounds=cfg.rollout.max_sampling_rounds if fit and cfg.rollout.dynamic_sampling else None,
            sharded=self.sharded, pad_token_id=self.tokenizer.pad_token_id,
            behaviour_logprobs=self._behaviour_logprobs if self.clip_budget is not None else None, gather=gather_objects,
            world_size=self.trainer.world_size,
        )
        if self._pending_rollouts is not None:  # what the checkpoint's run generated ahead
            source.load_state_dict(self._pending_rollouts, self.device)
            self._pending_rollouts = None
        return source

    def teardown(self, stage: str) -> None:
        if self.rollouts is not None:  # the producer first: it may be using the engine
            self.rollouts.close()
        self.worker.close()  # engines, started servers and pushed weight files now, not at interpreter exit

    def on_validation_start(self) -> None:
        self.step_phase = "evaluation"  # between steps: a stop may abandon it
        if self.rollouts is not None:  # the engine gets the current weights for evaluation: idle first
            self.rollouts.drain()
        self._start_worker()

    def on_validation_end(self) -> None:
        self.step_phase = None

    def on_test_start(self) -> None:
        self._start_worker()

    def _start_worker(self) -> None:
        cfg = self.settings
        trainer = self.trainer
        self.worker.start(EngineSpec(
            model_name_or_path=self.model_source, dtype=cfg.policy.dtype, prompt_length=cfg.rollout.prompt_length,
            response_length=cfg.rollout.response_length, seed=self.sampling_seed(0), trust_remote_code=cfg.policy.trust_remote_code,
            eos_token_ids=eos_token_ids(self.policy, self.tokenizer), pad_token_id=self.tokenizer.pad_token_id,
            rank=trainer.global_rank, local_rank=trainer.local_rank, world_size=trainer.world_size,
            policy=self.policy, tokenizer=self.tokenizer,
            # sharded weights are gathered in every forward: all ranks must take as many decode steps
            lockstep=(lambda done: all_ranks_true(done, self.device)) if self.sharded else None,
            lora=self.lora,
        ))

    def _build_updater(self, prompts_per_step: int, world: int = 1) -> None:
        cfg = self.settings
        settings = update_settings(cfg.update, cfg.objective, group_size=cfg.rollout.num_return_sequences_in_group,
                                   prompt_length=cfg.rollout.prompt_length, response_length=cfg.rollout.response_length,
                                   prompts_per_step=prompts_per_step, world=world,
                                   warn_no_clip=cfg.objective.old_logprobs == "recompute" and self.rollout_steps == 0,
                                   episodes=self.episodes is not None)
        state = self.updater.state_dict() if self.updater is not None else self._updater_state
        self.updater = PolicyUpdater(settings, self.step_metrics, self.metric_hooks)
        self.updater.load_state_dict(state)

    def on_fit_end(self) -> None:
        step, max_steps = self.trainer.global_step, self.trainer.max_steps
        if not self._trained_this_fit and max_steps is not None and 0 <= max_steps <= step:
            # Lightning restores the step after on_fit_start, then finds nothing to do: say so, export nothing
            raise ConfigError(f"the run is already at step {step} and trainer.max_steps={max_steps}: nothing to train. "
                             f"To continue from this checkpoint, set --trainer.max_steps above {step}")

    # -- one step ----------------------------------------------------------------------
    def sampling_seed(self, step: int) -> int:
        base = self.settings.rollout.rollout_seed if self.settings.rollout.rollout_seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        return step_seed(base, step, rank=self.global_rank)  # rank 0 without a trainer

    def _logprobs(self, model, rollout: Rollout, rows: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.settings
        return response_logprobs(
            model, rollout.input_ids[rows], rollout.attention_mask[rows], rollout.prompt_width,
            # the distribution the engine sampled from: temperature, then the top-k / top-p filters
            temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
            # the chunked path calls the decoder and the head separately: under FSDP2 both are
            # their own units, unless the model has parameters outside them (training/sharding.py)
            chunk_size=cfg.update.logprob_chunk_size if self._chunked_logprobs else None,
            images=rollout.images_of(rows),
        )

    def _logprobs_no_grad(self, model, rollout: Rollout) -> Tensor:
        """Log-probs of every response in micro-batches (old policy / reference passes)."""
        s = self.updater.settings if self.updater is not None else None
        micro = (s.no_grad_micro_batch_size or s.micro_batch_size) if s is not None else rollout.num_responses
        rows = torch.arange(rollout.num_responses, device=self.device)
        was_training = model.training
        model.eval()
        try:
            # inference_mode is leaner than no_grad, but MoE routing records must stay ordinary
            # tensors (used again under autograd in replay), and FSDP2 keeps buffers it creates in
            # the first forward (inference tensors would break the next training forward)
            with torch.no_grad() if self.routing_recorder is not None or self.sharded else torch.inference_mode():
                logprobs = torch.cat([self._logprobs(model, rollout, chunk)[0] for chunk in rows.split(micro)])
        finally:
            model.train(was_training)
        return logprobs.clone()  # a normal tensor again, usable next to autograd tensors

    def _reference_logprobs(self, rollout: Rollout) -> Optional[Tensor]:
        if self.lora is not None and self.needs_reference:  # the base: the policy with its adapters off
            with adapters_disabled(self.policy):
                return self._logprobs_no_grad(self.policy, rollout)
        return self._logprobs_no_grad(self.reference, rollout) if self.reference is not None else None

    def _behaviour_logprobs(self, model, rollout: Rollout) -> Tensor:
        """The clip budget's o_b, on the producer thread: under the trainer's precision (autocast is per thread)."""
        with self.trainer.precision_plugin.forward_context():
            return self._logprobs_no_grad(model, rollout)

    def _needs_old_pass(self, num_responses: int) -> bool:
        """With exactly one update, the old log-probs equal the first forward's own: skip the pass."""
        s, cfg = self.updater.settings, self.settings
        decoupled = self.off_policy is not None and self.off_policy.mode == "decoupled"  # weights need o before any update
        return s.ppo_epochs * (num_responses // s.mini_batch_size) > 1 or cfg.advantages.add_token_level_kl or cfg.update.routing_replay or decoupled

    def training_step(self, batch: dict, batch_idx: int) -> None:
        cfg = self.settings
        step_start = time.perf_counter()
        self.step_phase = "rollout"
        PHASES.begin(f"generating {len(batch['prompt_ids']) * cfg.rollout.num_return_sequences_in_group} responses")  # the progress display
        rollout, source_stats = self.rollouts.next(self.rollout_steps, batch, self.policy_version)
        if self.updater is None or self.updater.settings.mini_batch_size > rollout.num_responses:
            self._build_updater(len(batch["prompt_ids"]) * self.trainer.world_size, self.trainer.world_size)

        # passes before any update
        start = time.perf_counter()
        PHASES.begin("log-probs")
        if self.routing_recorder is not None:
            self.routing_recorder.clear()
        old = None
        if cfg.objective.old_logprobs == "engine":
            old = rollout.engine_logprobs
        elif self._needs_old_pass(rollout.num_responses):
            with self.routing_recorder.record() if self.routing_recorder is not None else contextlib.nullcontext():
                old = self._logprobs_no_grad(self.policy, rollout)
        # the trainer's own log-probs at this update's start (o): the old policy, or for the
        # clip budget / off-policy metrics beside the engine's old policy (bypass)
        trainer_old = old if cfg.objective.old_logprobs == "recompute" else None
        if trainer_old is None and cfg.objective.old_logprobs == "engine" and (self.clip_budget is not None or self.off_policy is not None):
            trainer_old = self._logprobs_no_grad(self.policy, rollout)
        ref = self._reference_logprobs(rollout)
        time_logprobs = time.perf_counter() - start
        for name, value in source_stats.items():
            self.step_metrics.update(name, value)
        if self.clip_budget is not None:  # a metric hook: splits each clip of this rollout's updates by cause
            self.clip_budget.begin(old=trainer_old, behaviour=rollout.engine_logprobs,
                                   behaviour_old=rollout.behaviour_trainer_logprobs, old_is_behaviour=cfg.objective.old_logprobs == "engine",
                                   same_weights=rollout.policy_version == self.policy_version)
        is_weights = importance_weights(trainer_old, rollout.engine_logprobs, rollout.response_mask, self.off_policy,
                                        self.step_metrics, all_reduce_sum)  # the ESS over all ranks' units

        _, advantages = cfg.advantages.compute(
            rollout.rewards, rollout.response_mask, rollout.group_size, running=self.running_rewards,
            old_logprobs=old if old is not None else rollout.engine_logprobs, ref_logprobs=ref,
            kl_estimator=cfg.objective.kl_estimator, reduce_sum=all_reduce_sum, scored=rollout.scored,
        )
        if self.episodes is not None and self.episodes.turn_advantages:  # GSPO-token: each turn its own return
            advantages = self.episodes.advantages(rollout.rewards, rollout.turn_rewards, rollout.turn_of_token,
                                                  rollout.group_size, rollout.scored)

        start = time.perf_counter()
        generator = torch.Generator().manual_seed(self.sampling_seed(self.rollout_steps) + 17)
        forward = self.grad_sync.policy_forward  # DDP: the policy's own wrapper, which syncs in backward
        if forward is None:
            forward = lambda *args: self._logprobs(self.policy, *args)  # noqa: E731
        scaling = LossScaling(getattr(self.trainer.precision_plugin, "scaler", None))
        ops = StrategyOps(self, self.trainer.strategy, self.optimizers(), self.lr_schedulers(), list(self.policy.parameters()),
                          self.grad_sync, scaling, cfg.update.max_grad_norm)
        PHASES.begin_update(self.updater.settings, rollout.num_responses)
        self.step_phase = "update"  # until the update ends the weights are no step boundary's
        self.policy_version += self.updater.run(
            rollout, advantages, old, ref, lambda rows: forward(rollout, rows), ops,
            routing_recorder=self.routing_recorder, generator=generator, is_weights=is_weights,
        )
        self.step_phase = None
        time_train = time.perf_counter() - start
        self.rollout_steps += 1
        self._trained_this_fit = True
        self._log_step(batch, rollout, advantages, time_logprobs, time_train, time.perf_counter() - step_start)

    def _log_step(self, batch, rollout: Rollout, advantages: Tensor, time_logprobs: float, time_train: float, elapsed: float) -> None:
        timings = {"time/logprobs": time_logprobs, "time/train": time_train, **rollout.timings}
        values = step_values(self.step_metrics, rollout, advantages, timings, elapsed)
        values["policy_version"] = float(self.policy_version)
        values["skipped_updates"] = float(self.updater.skipped_updates)
        values["lr"] = float(self.optimizers().param_groups[0]["lr"])
        values["step"] = float(self.trainer.global_step)  # the loggers' x: steps done, as in evaluations and checkpoints
        values.update(batch.get("stats", {}))  # prompts kept / truncated / dropped / bad
        for line in self.constant_rewards.update(rollout.reward_components):
            rank_zero_warn(line)
        if rollout.reward_errors and self.settings.rollout.on_reward_error == "zero":
            warnings.warn(f"step {self.rollout_steps}: {rollout.reward_errors} response(s) scored 0 because a reward "
                          f"function failed (on_reward_error=zero); see reward/errors in the logs", stacklevel=2)
        n = rollout.num_responses
        self.log_dict(values, on_step=True, on_epoch=False, batch_size=n)
        self.log_dict({"reward": values["reward/mean"], "step_s": values["time/step"]}, on_step=True, on_epoch=False,
                      prog_bar=True, logger=False, batch_size=n)

    # -- evaluation --------------------------------------------------------------------
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, "test")

    def _eval_step(self, batch: dict, batch_idx: int, stage: str) -> None:
        if self.rollouts is None:  # gspo validate / test: no fit built one
            self.rollouts = self._rollout_source(0, fit=False)
        rollout = self.rollouts.rollout(batch, self.sampling_seed(10_000_000 + batch_idx), self.policy_version, evaluation=True)
        record_eval_rollout(self.val_metrics, stage, rollout.rewards, rollout.lengths, rollout.group_size,
                            self.settings.evaluation.accuracy_threshold)

    def on_validation_epoch_end(self) -> None:
        values = self.val_metrics.compute()
        if not values:
            return
        self.log_dict({**values, "step": float(eval_step(self.trainer, self))}, on_step=False, on_epoch=True, prog_bar=False)
        self.last_eval_metrics = values  # the run's EvalRecords callback writes eval_results.jsonl from these

    on_test_epoch_end = on_validation_epoch_end  # the same metrics and record, under test/
