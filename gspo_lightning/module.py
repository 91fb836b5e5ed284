"""``GSPOModule``: the policy, its frozen reference, and the GSPO update loop.

One ``training_step`` consumes one rollout batch (filled in by ``RolloutCallback``):

1. log-prob passes that are needed before any update (old policy, reference), no grad
2. rewards -> advantages (``advantages.py``)
3. ``ppo_epochs`` x mini-batches: each mini-batch is one optimizer step, accumulated over
   micro-batches with the loss denominators of the whole mini-batch (``loss.py``)
4. metrics -> loggers; ``policy_version`` counts optimizer steps
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Literal, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from gspo_lightning.advantages import GROUP_ESTIMATORS, RunningMoments, rewards_to_advantages
from gspo_lightning.evaluation import pass_at_k
from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.loss import policy_loss
from gspo_lightning.metrics import StepMetrics
from gspo_lightning.models import eos_token_ids, load_policy, load_tokenizer
from gspo_lightning.rewards.base import RewardComposer, RewardSpec
from gspo_lightning.rollout.callback import Rollout, RolloutCallback

log = logging.getLogger(__name__)

# Clip ranges follow the level of the ratio they clip (GSPO paper, section 5.1 / ROLL).
DEFAULT_CLIP = {"seq": (3e-4, 4e-4), "seq-token": (3e-4, 4e-4), "token": (0.2, 0.27)}


def _is_moe(model) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))


class NonFiniteError(RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient."""


class GSPOModule(L.LightningModule):
    """GSPO (and GRPO-family) training of a causal language model.

    Args:
        model_name_or_path: hub id, local folder, or ``builtin:<name>`` (a tiny local model).
        dtype: weight dtype: ``float32``, ``bfloat16`` or ``float16``.
        attn_implementation: passed to ``from_pretrained`` (``sdpa``, ``flash_attention_2``...).
        gradient_checkpointing: recompute decoder activations in backward to save memory.
        trust_remote_code: allow a hub model's own Python code (off unless you trust it).
        rewards: the reward functions (import path, weight, kwargs, name).
        on_reward_error: ``raise`` stops on a failing reward function; ``zero`` scores 0 and counts.
        engine: ``hf`` (the policy itself, any device) or ``vllm`` (GPU, ``pip install .[vllm]``).
        engine_kwargs: extra engine arguments; vLLM: ``gpu_memory_utilization`` (0.3),
            ``weight_sync_bucket_mb`` (256), ``sleep_level`` (0: off), ``tensor_parallel_size``,
            ``max_model_len``, ``load_mode`` and any ``vllm.LLM`` argument (see docs/vllm.md).
        num_return_sequences_in_group: responses per prompt, ``G`` (ROLL's key).
        response_length: most new tokens per response (ROLL's key).
        temperature: sampling temperature; log-probs are taken at the same temperature.
        top_p: nucleus sampling mass (1: off).
        top_k: top-k sampling (0: off).
        generation_batch_size: responses sampled at once (``None``: all).
        val_num_samples: responses per validation prompt (pass@k uses k = this).
        val_temperature: validation sampling temperature (0: greedy).
        accuracy_threshold: a response counts as correct when its reward is at least this.
        adv_estimator: ``grpo``, ``reinforce``, ``rloo`` or ``dr_grpo``.
        reward_norm: ``null``, ``group``, ``batch`` or ``running`` normalization of rewards.
        reward_shift: with ``reward_norm``, only subtract the mean.
        reward_scale: with ``reward_norm``, only divide by the std.
        reward_clip: clip rewards to ``[-c, c]`` after normalization (``null``: off).
        add_token_level_kl: put ``-kl_coef * KL(old, ref)`` into every token's reward.
        kl_coef: coefficient of the token-level KL reward.
        whiten_advantages: whiten advantages over all valid tokens of the batch.
        advantage_clip: clip advantages to ``[-c, c]`` (``null``: off).
        importance_sampling: ``seq`` (GSPO), ``seq-token`` (GSPO-token) or ``token`` (GRPO).
        clip_low: ratio clip below 1 (``null``: 3e-4 for sequence levels, 0.2 for token).
        clip_high: ratio clip above 1 (``null``: 4e-4 for sequence levels, 0.27 for token).
        dual_clip_loss: bound the loss of negative-advantage samples (ROLL's key).
        dual_clip: the dual-clip constant ``c > 1``.
        loss_agg_mode: ``seq-mean-token-mean`` (the paper), ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm`` or ``token-mean``.
        use_kl_loss: add ``kl_loss_coef * KL(policy, ref)`` to the loss.
        kl_loss_coef: its coefficient.
        kl_estimator: ``k1``, ``k2`` or ``k3`` for both KL terms.
        ppo_epochs: passes over each rollout batch.
        mini_batch_size: responses per optimizer step, over all ranks (``null``: the whole
            rollout batch, one step). Several per rollout are what let the clip act.
        micro_batch_size: responses per forward/backward on each rank (``null``: the whole
            local mini-batch); a memory knob that never changes the gradient.
        max_grad_norm: gradient norm clip (``null``: off).
        old_logprobs: ``recompute`` the old policy's log-probs with the trainer, or take the
            ``engine``'s sampled-token log-probs (no extra pass; the paper's shortcut).
        logprob_chunk_size: response tokens projected to the vocabulary at once (``null``:
            the naive full-logits path).
        max_consecutive_nonfinite: stop after this many skipped (non-finite) updates in a row.
        routing_replay: Mixture-of-Experts only: record the experts each token used in the
            old-policy pass and force them in the training forwards (the baseline GRPO needs
            on MoE models); always logs how much routing changed between old and new policy.
        router_aux_loss_coef: Mixture-of-Experts load-balancing loss coefficient (0: off).
        export_on_fit_end: save the policy with ``save_pretrained`` (safetensors + tokenizer)
            to ``<log dir>/hf_model`` when ``fit`` ends.
        rollout_seed: base seed of sampling (``null``: the run's ``seed_everything`` seed).
        optimizer: optimizer factory (default AdamW, lr 1e-6).
        lr_scheduler: scheduler factory, stepped once per optimizer step.
    """

    def __init__(
        self,
        model_name_or_path: str = "builtin:tiny-echo",
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        attn_implementation: Optional[str] = None,
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        rewards: Optional[list[RewardSpec]] = None,
        on_reward_error: Literal["raise", "zero"] = "raise",
        engine: Literal["hf", "vllm"] = "hf",
        engine_kwargs: Optional[dict[str, Any]] = None,
        num_return_sequences_in_group: int = 8,
        response_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        generation_batch_size: Optional[int] = None,
        val_num_samples: int = 1,
        val_temperature: float = 0.0,
        accuracy_threshold: float = 1.0,
        adv_estimator: Literal["grpo", "reinforce", "rloo", "dr_grpo"] = "grpo",
        reward_norm: Optional[Literal["group", "batch", "running"]] = None,
        reward_shift: bool = False,
        reward_scale: bool = False,
        reward_clip: Optional[float] = None,
        add_token_level_kl: bool = False,
        kl_coef: float = 0.0,
        whiten_advantages: bool = False,
        advantage_clip: Optional[float] = None,
        importance_sampling: Literal["seq", "seq-token", "token"] = "seq",
        clip_low: Optional[float] = None,
        clip_high: Optional[float] = None,
        dual_clip_loss: bool = False,
        dual_clip: float = 3.0,
        loss_agg_mode: Literal["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean"] = "seq-mean-token-mean",
        use_kl_loss: bool = False,
        kl_loss_coef: float = 0.001,
        kl_estimator: Literal["k1", "k2", "k3"] = "k3",
        ppo_epochs: int = 1,
        mini_batch_size: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        max_grad_norm: Optional[float] = 1.0,
        old_logprobs: Literal["recompute", "engine"] = "recompute",
        logprob_chunk_size: Optional[int] = 512,
        max_consecutive_nonfinite: int = 3,
        routing_replay: bool = False,
        router_aux_loss_coef: float = 0.0,
        export_on_fit_end: bool = True,
        rollout_seed: Optional[int] = None,
        optimizer: Optional[OptimizerCallable] = None,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", "rewards"])
        # plain dicts, so checkpoints load with torch.load(weights_only=True)
        self.hparams["rewards"] = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in rewards or []] or None
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self._validate_config()
        default_low, default_high = DEFAULT_CLIP[importance_sampling]
        self.clip_low = default_low if clip_low is None else clip_low
        self.clip_high = default_high if clip_high is None else clip_high
        self.automatic_optimization = False

        self.tokenizer = load_tokenizer(model_name_or_path, trust_remote_code)
        self.policy = None
        self.reference = None
        self.engine = None
        self.reward_composer = RewardComposer(self.hparams["rewards"], on_error=on_reward_error) if rewards else None
        self.running_rewards = RunningMoments()
        self.step_metrics = StepMetrics()
        self.val_metrics = StepMetrics()
        self.policy_version = 0  # optimizer steps taken; the weights a rollout was sampled with
        self.rollout_steps = 0  # rollout batches consumed (the data position)
        self.skipped_updates = 0
        self.consecutive_nonfinite = 0
        self.router = None  # gspo_lightning.moe.RoutingRecorder for MoE policies
        self.grad_sync, self.loss_scale = "none", 1.0
        self.sharded = False  # parameters split over ranks (FSDP2)

    # -- configuration -----------------------------------------------------------------
    def _validate_config(self) -> None:
        hp = self.hparams
        G = hp.num_return_sequences_in_group
        problems = []
        if G < 1:
            problems.append(f"num_return_sequences_in_group must be >= 1, got {G}")
        if hp.adv_estimator in GROUP_ESTIMATORS and G < 2:
            problems.append(f"adv_estimator={hp.adv_estimator} compares responses of a prompt: set num_return_sequences_in_group >= 2 (or use reinforce)")
        if hp.reward_norm == "group" and G < 2:
            problems.append("reward_norm=group needs num_return_sequences_in_group >= 2")
        for name in ("clip_low", "clip_high", "reward_clip", "advantage_clip", "kl_loss_coef", "kl_coef"):
            value = getattr(hp, name)
            if value is not None and value < 0:
                problems.append(f"{name} must be >= 0, got {value}")
        if hp.clip_low is not None and hp.clip_low >= 1:
            problems.append(f"clip_low must be < 1 (the ratio is clipped at 1 - clip_low), got {hp.clip_low}")
        if hp.dual_clip_loss and hp.dual_clip <= 1:
            problems.append(f"dual_clip must be > 1 (3 is usual), got {hp.dual_clip}")
        if (hp.reward_shift or hp.reward_scale) and hp.reward_norm is None:
            problems.append("reward_shift / reward_scale act only with a reward_norm: set reward_norm (group, batch or running) or turn them off")
        if hp.reward_shift and hp.reward_scale:
            problems.append("reward_shift and reward_scale are exclusive (set neither to both shift and scale)")
        if hp.routing_replay and hp.old_logprobs == "engine":
            problems.append("routing_replay records routing in the trainer's old-policy pass: set old_logprobs=recompute")
        if hp.add_token_level_kl and hp.kl_coef == 0:
            problems.append("add_token_level_kl needs kl_coef > 0")
        if hp.ppo_epochs < 1:
            problems.append(f"ppo_epochs must be >= 1, got {hp.ppo_epochs}")
        for name in ("mini_batch_size", "micro_batch_size", "generation_batch_size", "logprob_chunk_size"):
            value = getattr(hp, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be >= 1 or null, got {value}")
        if hp.mini_batch_size and hp.micro_batch_size and hp.mini_batch_size % hp.micro_batch_size:
            problems.append(f"mini_batch_size={hp.mini_batch_size} is not a multiple of micro_batch_size={hp.micro_batch_size}")
        if hp.response_length < 1:
            problems.append(f"response_length must be >= 1, got {hp.response_length}")
        if hp.val_num_samples < 1:
            problems.append(f"val_num_samples must be >= 1, got {hp.val_num_samples}")
        if hp.temperature <= 0:
            problems.append(f"temperature must be > 0 for training rollouts, got {hp.temperature}")
        if problems:
            raise ValueError("invalid GSPO configuration:\n  - " + "\n  - ".join(problems))
        if hp.importance_sampling != "token":
            for name in ("clip_low", "clip_high"):
                value = getattr(hp, name)
                if value is not None and value >= 0.1:
                    warnings.warn(
                        f"{name}={value} with importance_sampling={hp.importance_sampling}: sequence-level ratios "
                        f"stay within ~1e-3 of 1, so a token-sized clip range almost never clips (the paper uses 3e-4 / 4e-4)",
                        stacklevel=3,
                    )

    @property
    def needs_reference(self) -> bool:
        return self.hparams.use_kl_loss or self.hparams.add_token_level_kl

    def configure_model(self) -> None:
        """Load the policy (and the reference, when a KL term needs it) once."""
        if self.policy is not None:
            return
        hp = self.hparams
        self.policy = load_policy(hp.model_name_or_path, self.tokenizer, hp.dtype, hp.attn_implementation, hp.trust_remote_code)
        if hp.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.policy.config.use_cache = False
        if self.needs_reference:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        mesh = getattr(self, "_device_mesh", None)  # set by ModelParallelStrategy (FSDP2)
        if mesh is not None:
            self._fully_shard(mesh)
        if hp.routing_replay or hp.router_aux_loss_coef > 0 or _is_moe(self.policy):
            from gspo_lightning.moe import RoutingRecorder

            self.router = RoutingRecorder(self.policy)

    def _fully_shard(self, mesh) -> None:
        """FSDP2: shard each decoder layer, then the rest (embeddings, head) at the root."""
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
        for layer in self.policy.get_decoder().layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.policy, mesh=dp_mesh)
        self.sharded = True

    def setup(self, stage: str) -> None:
        self.configure_model()
        if self.reward_composer is None:
            raise ValueError("no reward functions configured: set model.rewards, e.g. "
                             "[{function: gspo_lightning.rewards.math_accuracy}]")

    def configure_callbacks(self):
        from gspo_lightning.plotting import TrainingCurves
        from gspo_lightning.preemption import PreemptionCheckpoint

        return [RolloutCallback(), TrainingCurves(), PreemptionCheckpoint()]

    def on_fit_start(self) -> None:
        self._setup_gradient_sync()
        # batch sizes that do not divide fail now, not after the first rollout
        prompts = getattr(getattr(self.trainer, "datamodule", None), "hparams", {}).get("rollout_batch_size")
        if prompts is not None:
            if prompts % self.world_size:
                raise ValueError(f"data.rollout_batch_size={prompts} does not split over {self.world_size} ranks")
            self.updates_per_rollout(prompts // self.world_size * self.hparams.num_return_sequences_in_group)
        self._make_engine()

    def on_fit_end(self) -> None:
        if not self.hparams.export_on_fit_end:
            return
        folder = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "hf_model"  # collective call
        if self.sharded:
            log.warning("export_on_fit_end is skipped for sharded policies: export from the checkpoint instead")
            return
        if self.trainer.is_global_zero:
            from gspo_lightning.export import save_policy

            save_policy(self.policy, self.tokenizer, folder)
            print(f"policy exported to {folder}")

    def _setup_gradient_sync(self) -> None:
        """DDP: its reducer expects one backward per forward, but a GSPO step runs many
        backwards inside one ``training_step``; so gradients stay local and are summed over
        ranks once per optimizer step (:meth:`_all_reduce_gradients`). Sharded strategies
        (FSDP, FSDP2, DeepSpeed) reduce in backward themselves, averaging over ranks."""
        from lightning.pytorch.strategies import DDPStrategy

        self.grad_sync, self.loss_scale = "none", 1.0
        if type(self.trainer.strategy).__name__ == "DeepSpeedStrategy":
            self.grad_sync = "deepspeed"
        if self.world_size == 1:
            return
        strategy = self.trainer.strategy
        if type(strategy).__name__ == "DeepSpeedStrategy":
            self.grad_sync, self.loss_scale = "deepspeed", float(self.world_size)
        elif isinstance(strategy, DDPStrategy):
            self.trainer.model.require_backward_grad_sync = False
            self.grad_sync = "manual"
        else:
            self.grad_sync, self.loss_scale = "strategy", float(self.world_size)

    def _all_reduce_gradients(self, finite: bool) -> bool:
        """Sum gradients over ranks in flat buckets; returns whether every rank was finite."""
        flag = self.all_reduce_sum(torch.tensor([0.0 if finite else 1.0], device=self.device))
        if flag.item() > 0:
            return False
        params = [p for p in self.policy.parameters() if p.requires_grad]
        for p in params:  # a parameter unused on one rank (an idle expert) must still join the sum
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        bucket_bytes = 64 * 2**20
        bucket, size = [], 0
        for grad in grads + [None]:
            if grad is not None:
                bucket.append(grad)
                size += grad.numel() * grad.element_size()
            if bucket and (grad is None or size >= bucket_bytes):
                flat = torch._utils._flatten_dense_tensors(bucket)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                for g, synced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                    g.copy_(synced)
                bucket, size = [], 0
        return True

    def on_validation_start(self) -> None:
        self._make_engine()

    def on_test_start(self) -> None:
        self._make_engine()

    def _make_engine(self) -> None:
        if self.engine is not None:
            return
        hp = self.hparams
        eos = eos_token_ids(self.policy, self.tokenizer)
        if hp.engine == "hf":
            from gspo_lightning.rollout.hf import HFEngine

            # sharded weights are gathered in every forward: all ranks must take as many decode steps
            all_finished = self._all_ranks_finished if self.sharded else None
            self.engine = HFEngine(self.policy, eos, self.tokenizer.pad_token_id, hp.generation_batch_size, all_finished)
        else:
            from gspo_lightning.rollout.vllm import VLLMEngine

            self.engine = VLLMEngine.from_module(self, eos, **(hp.engine_kwargs or {}))

    def configure_optimizers(self):
        if self.policy is None:
            self.configure_model()
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params) if self.optimizer_factory else torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "step"}}

    # -- helpers -----------------------------------------------------------------------
    def sampling_seed(self, step: int) -> int:
        base = self.hparams.rollout_seed if self.hparams.rollout_seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        rank = self.global_rank if self._trainer is not None else 0
        return ((base * 1_000_003 + step) * 1031 + rank) % (2**63 - 1)

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self._trainer is not None else 1

    def _all_ranks_finished(self, finished: bool) -> bool:
        return bool(self.all_reduce_sum(torch.tensor([0.0 if finished else 1.0], device=self.device)).item() == 0)

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            tensor = tensor.clone()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def _logprobs(self, model, rollout: Rollout, rows: Tensor) -> tuple[Tensor, Tensor]:
        return response_logprobs(
            model, rollout.input_ids[rows], rollout.attention_mask[rows], rollout.prompt_width,
            temperature=self.hparams.temperature,
            # the chunked path calls the decoder and head separately, bypassing the root's
            # FSDP2 all-gather of embeddings and head: sharded policies take the naive path
            chunk_size=None if self.sharded else self.hparams.logprob_chunk_size,
        )

    def _logprobs_no_grad(self, model, rollout: Rollout) -> Tensor:
        """Log-probs of every response in micro-batches (old policy / reference passes)."""
        micro = self.hparams.micro_batch_size or rollout.num_responses
        rows = torch.arange(rollout.num_responses, device=self.device)
        was_training = model.training
        model.eval()
        try:
            # inference_mode is leaner than no_grad, but MoE routing records must stay
            # ordinary tensors: they are used again under autograd during replay
            with torch.no_grad() if self.router is not None else torch.inference_mode():
                logprobs = torch.cat([self._logprobs(model, rollout, chunk)[0] for chunk in rows.split(micro)])
        finally:
            model.train(was_training)
        return logprobs.clone()  # a normal tensor again, usable next to autograd tensors

    def local_mini_batch_size(self, num_responses: int) -> int:
        """Responses per optimizer step on this rank (``mini_batch_size`` counts all ranks)."""
        mini = self.hparams.mini_batch_size
        if mini is None:
            return num_responses
        if mini % self.world_size:
            raise ValueError(f"mini_batch_size={mini} does not split over {self.world_size} ranks: make it a multiple of {self.world_size}")
        local = mini // self.world_size
        if num_responses % local:
            raise ValueError(
                f"the {num_responses * self.world_size} responses of a step (rollout_batch_size x num_return_sequences_in_group) "
                f"do not split into mini-batches of {mini}: make mini_batch_size divide them")
        return local

    def updates_per_rollout(self, num_responses: int) -> int:
        return self.hparams.ppo_epochs * (num_responses // self.local_mini_batch_size(num_responses))

    # -- the update --------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> None:
        hp = self.hparams
        rollout: Rollout = batch.get("rollout")
        if rollout is None:
            raise RuntimeError("the batch has no rollout: GSPOModule must run with its RolloutCallback")
        if rollout.policy_version != self.policy_version:
            raise RuntimeError(f"stale rollout: sampled with policy version {rollout.policy_version}, "
                               f"the policy is at {self.policy_version}")
        step_start = time.perf_counter()
        num = rollout.num_responses
        mask = rollout.response_mask

        # 1. passes before any update
        start = time.perf_counter()
        if self.router is not None:
            self.router.clear()
        single_update = self.updates_per_rollout(num) == 1
        old = None
        if hp.old_logprobs == "engine":
            old = rollout.engine_logprobs
        elif not single_update or hp.add_token_level_kl or hp.routing_replay:
            with self.router.record() if self.router is not None else contextlib.nullcontext():
                old = self._logprobs_no_grad(self.policy, rollout)
        # else: with exactly one update the old log-probs equal the first forward's, so skip the pass
        ref = self._logprobs_no_grad(self.reference, rollout) if self.reference is not None else None
        time_logprobs = time.perf_counter() - start

        # 2. advantages
        scores, advantages = rewards_to_advantages(
            rollout.rewards, mask, rollout.group_size,
            adv_estimator=hp.adv_estimator, reward_norm=hp.reward_norm, reward_shift=hp.reward_shift,
            reward_scale=hp.reward_scale, reward_clip=hp.reward_clip, running=self.running_rewards,
            add_token_level_kl=hp.add_token_level_kl,
            old_logprobs=old if old is not None else rollout.engine_logprobs, ref_logprobs=ref,
            kl_coef=hp.kl_coef, kl_estimator=hp.kl_estimator, whiten_advantages=hp.whiten_advantages,
            advantage_clip=hp.advantage_clip, reduce_sum=self.all_reduce_sum,
        )

        # 3. updates
        start = time.perf_counter()
        self._update(rollout, advantages, old, ref)
        time_train = time.perf_counter() - start
        self.rollout_steps += 1

        # 4. metrics
        self._rollout_metrics(rollout, advantages)
        m = self.step_metrics
        m.update("time/logprobs", time_logprobs)
        m.update("time/train", time_train)
        for name, value in rollout.timings.items():
            m.update(name, value)
        step_time = time.perf_counter() - step_start + sum(v for k, v in rollout.timings.items() if k.startswith("time/"))
        m.update("time/step", step_time)
        tokens = rollout.attention_mask.sum()
        m.update("perf/samples_per_s", num / step_time)
        m.update("perf/tokens_per_s", tokens / step_time)
        values = m.compute()
        sq_mean = values.pop("reward/sq_mean")
        values["reward/std"] = math.sqrt(max(0.0, sq_mean - values["reward/mean"] ** 2))
        values["policy_version"] = float(self.policy_version)
        values["skipped_updates"] = float(self.skipped_updates)
        values["lr"] = float(self.optimizers().param_groups[0]["lr"])
        datamodule = getattr(self.trainer, "datamodule", None)
        values.update(getattr(datamodule, "stats", {}))  # prompts kept / truncated / dropped / bad
        progress = {"reward": values["reward/mean"], "step_s": values["time/step"]}
        self.log_dict(values, on_step=True, on_epoch=False, batch_size=num)
        self.log_dict(progress, on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=num)

    def _update(self, rollout: Rollout, advantages: Tensor, old: Optional[Tensor], ref: Optional[Tensor]) -> None:
        hp = self.hparams
        num = rollout.num_responses
        mini = self.local_mini_batch_size(num)
        micro = hp.micro_batch_size or mini
        mask = rollout.response_mask
        lengths = rollout.lengths
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        m = self.step_metrics
        generator = torch.Generator().manual_seed(self.sampling_seed(self.rollout_steps) + 17)
        first_minibatch = True
        for epoch in range(hp.ppo_epochs):
            order = torch.arange(num) if (hp.ppo_epochs == 1 and mini == num) else torch.randperm(num, generator=generator)
            for mini_rows in order.to(self.device).split(mini):
                # denominators of the whole optimizer step, over all ranks
                counts = self.all_reduce_sum(torch.stack([(lengths[mini_rows] > 0).sum(), mask[mini_rows].sum()]).float())
                optimizer.zero_grad(set_to_none=True)
                finite = True
                minibatch_loss = 0.0
                for rows in mini_rows.split(micro):
                    logprobs, entropy, aux_loss = self._train_forward(rollout, rows, first_minibatch and epoch == 0)
                    micro_mask = mask[rows]
                    micro_old = old[rows] if old is not None else logprobs.detach()
                    loss, metrics = policy_loss(
                        logprobs, micro_old, advantages[rows], micro_mask,
                        importance_sampling=hp.importance_sampling, clip_low=self.clip_low, clip_high=self.clip_high,
                        dual_clip=hp.dual_clip if hp.dual_clip_loss else None, loss_agg_mode=hp.loss_agg_mode,
                        ref_logprobs=ref[rows] if ref is not None else None,
                        kl_coef=hp.kl_loss_coef if hp.use_kl_loss else 0.0, kl_estimator=hp.kl_estimator,
                        num_seqs=counts[0], num_tokens=counts[1], horizon=hp.response_length,
                    )
                    if not self._finite_on_all_ranks(loss):
                        finite = False  # every rank skips together: sharded backwards are collective
                        break
                    if aux_loss is not None:
                        # the load-balancing loss is a mean per micro-batch: weigh it by its share
                        loss = loss + hp.router_aux_loss_coef * aux_loss * (len(rows) / len(mini_rows))
                    # the loss already divides by global counts: the step's gradient is the
                    # SUM over ranks (sharded strategies average, hence the factor)
                    self.manual_backward(loss * self.loss_scale)
                    minibatch_loss += float(loss.detach())
                    self._loss_metrics(metrics, micro_mask, lengths[rows], entropy)
                    if first_minibatch and epoch == 0:
                        self._mismatch_metrics(rollout, rows, logprobs.detach())
                if self.grad_sync == "manual":
                    finite = self._all_reduce_gradients(finite)
                grad_norm = self._clip_gradients() if finite else torch.tensor(float("nan"))
                if finite and torch.isfinite(grad_norm):
                    optimizer.step()
                    if scheduler is not None:
                        scheduler.step()
                    self.policy_version += 1
                    self.consecutive_nonfinite = 0
                    m.update("grad_norm", grad_norm)
                    # summed over ranks: each rank's loss already divides by the global counts
                    m.update("loss/policy", self.all_reduce_sum(torch.tensor(minibatch_loss, device=self.device)))
                else:
                    self._skip_update()
                first_minibatch = False

    def _train_forward(self, rollout: Rollout, rows: Tensor, before_any_update: bool):
        """The policy's log-probs with grad; on MoE policies, with routing replay / change
        measurement and the load-balancing loss when configured."""
        if self.router is None:
            return (*self._logprobs(self.policy, rollout, rows), None)
        hp = self.hparams
        with contextlib.ExitStack() as stack:
            if hp.routing_replay:
                stack.enter_context(self.router.replay(rows))
            elif self.router.has_record and not before_any_update:
                change = stack.enter_context(self.router.measure(rows))
            else:
                change = None
            capture = stack.enter_context(self.router.capture_router_logits()) if hp.router_aux_loss_coef > 0 else None
            logprobs, entropy = self._logprobs(self.policy, rollout, rows)
        if not hp.routing_replay and change is not None and change.value is not None:
            self.step_metrics.update("moe/routing_change", change.value)
        aux = capture.load_balancing_loss(rollout.attention_mask[rows]) if capture is not None else None
        return logprobs, entropy, aux

    def _finite_on_all_ranks(self, loss: Tensor) -> bool:
        bad = torch.tensor([0.0 if bool(torch.isfinite(loss)) else 1.0], device=self.device)
        return bool(self.all_reduce_sum(bad).item() == 0)

    def _clip_gradients(self) -> Tensor:
        if self.grad_sync == "deepspeed":
            # DeepSpeed owns the gradients (set gradient_clipping in its config) and skips
            # overflowing steps itself
            return torch.tensor(0.0, device=self.device)
        params = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.hparams.max_grad_norm if self.hparams.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
            norm = norm.full_tensor()
        return norm.detach()

    def _skip_update(self) -> None:
        self.optimizers().zero_grad(set_to_none=True)
        self.skipped_updates += 1
        self.consecutive_nonfinite += 1
        log.warning("skipped an update with a non-finite loss or gradient (%d in a row)", self.consecutive_nonfinite)
        if self.consecutive_nonfinite >= self.hparams.max_consecutive_nonfinite:
            raise NonFiniteError(
                f"{self.consecutive_nonfinite} updates in a row had a non-finite loss or gradient. Lower the learning "
                f"rate, set max_grad_norm, check the reward scale, or raise max_consecutive_nonfinite."
            )

    # -- metrics -----------------------------------------------------------------------
    def _loss_metrics(self, metrics: dict[str, Tensor], mask: Tensor, lengths: Tensor, entropy: Tensor) -> None:
        m = self.step_metrics
        seq_level = self.hparams.importance_sampling != "token"
        units = (lengths > 0).sum() if seq_level else mask.sum()
        for name in ("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean"):
            m.update(f"loss/{name}", metrics[name], units)
        m.update("loss/ratio_max", metrics["ratio_max"], kind="max")
        m.update("loss/ratio_min", metrics["ratio_min"], kind="min")
        if "kl" in metrics:
            m.update("kl", metrics["kl"], mask.sum())
        valid = mask.bool()
        m.update("entropy", entropy[valid].mean() if valid.any() else torch.tensor(float("nan")), valid.sum())

    def _mismatch_metrics(self, rollout: Rollout, rows: Tensor, trainer_logprobs: Tensor) -> None:
        """How far the engine's sampled-token log-probs are from the trainer's (same weights)."""
        mask = rollout.response_mask[rows]
        diff = torch.where(mask, trainer_logprobs - rollout.engine_logprobs[rows], torch.zeros_like(trainer_logprobs))
        lengths = mask.sum(-1)
        m = self.step_metrics
        m.update("engine/logprob_abs_diff", diff.abs().sum() / mask.sum().clamp(min=1), mask.sum())
        seq_log_ratio = diff.sum(-1)[lengths > 0] / lengths[lengths > 0]
        if seq_log_ratio.numel():
            m.update("engine/seq_log_ratio_abs_max", seq_log_ratio.abs().max(), kind="max")

    def _rollout_metrics(self, rollout: Rollout, advantages: Tensor) -> None:
        m = self.step_metrics
        rewards = rollout.rewards
        m.update("reward/mean", rewards.mean(), rewards.numel())
        m.update("reward/sq_mean", rewards.square().mean(), rewards.numel())
        for name, values in rollout.reward_components.items():
            m.update(f"reward/{name}", values.mean(), values.numel())
        grouped = rewards.view(-1, rollout.group_size)
        zero_std = (grouped.max(-1).values == grouped.min(-1).values).float()
        m.update("reward/zero_std_groups", zero_std.mean(), zero_std.numel())
        lengths = rollout.lengths.float()
        m.update("response/length_mean", lengths.mean(), lengths.numel())
        m.update("response/length_max", lengths.max(), kind="max")
        m.update("response/truncated_frac", rollout.truncated.float().mean(), lengths.numel())
        valid = rollout.response_mask
        m.update("advantage/mean", advantages[valid].mean() if valid.any() else 0.0, valid.sum())
        m.update("reward/errors", float(rollout.reward_errors), kind="max")

    # -- evaluation --------------------------------------------------------------------
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _eval_step(self, batch: dict, stage: str) -> None:
        rollout: Rollout = batch["rollout"]
        k = rollout.group_size
        rewards = rollout.rewards.view(-1, k)
        correct = rewards >= self.hparams.accuracy_threshold
        m = self.val_metrics
        m.update(f"{stage}/reward_mean", rewards.mean(), rewards.numel())
        m.update(f"{stage}/accuracy", correct.float().mean(), rewards.numel())
        # the unbiased pass@1 over k samples is the share of correct samples
        m.update(f"{stage}/pass@1", correct.float().mean(), rewards.numel())
        m.update(f"{stage}/response_length", rollout.lengths.float().mean(), rewards.numel())
        if k > 1:
            per_prompt = [pass_at_k(k, int(c), k) for c in correct.sum(-1).tolist()]
            m.update(f"{stage}/pass@{k}", torch.tensor(per_prompt).mean(), len(per_prompt))

    def on_validation_epoch_end(self) -> None:
        self._log_eval()

    def on_test_epoch_end(self) -> None:
        self._log_eval()

    def _log_eval(self) -> None:
        values = self.val_metrics.compute()
        if not values:
            return
        self.log_dict(values, on_step=False, on_epoch=True, prog_bar=False)
        self.last_eval_metrics = values
        folder = Path(self.trainer.log_dir or self.trainer.default_root_dir)  # a collective call: every rank
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            folder.mkdir(parents=True, exist_ok=True)
            record = {"policy_version": self.policy_version, "rollout_steps": self.rollout_steps, **values}
            with open(folder / "eval_results.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")

    # -- checkpoints -------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # the reference is the initial policy, rebuilt from model_name_or_path on load
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("reference.")}
        checkpoint["gspo"] = {
            "policy_version": self.policy_version,
            "rollout_steps": self.rollout_steps,
            "skipped_updates": self.skipped_updates,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "running_rewards": self.running_rewards.state_dict(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.reference is not None:
            checkpoint["state_dict"].update({f"reference.{k}": v for k, v in self.reference.state_dict().items()})
        state = checkpoint.get("gspo")
        if state:
            self.policy_version = state["policy_version"]
            self.rollout_steps = state["rollout_steps"]
            self.skipped_updates = state["skipped_updates"]
            self.consecutive_nonfinite = state["consecutive_nonfinite"]
            self.running_rewards.load_state_dict(state["running_rewards"])
