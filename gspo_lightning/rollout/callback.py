"""Fresh rollouts for every step: generate with the current weights, then score.

Lightning fetches the next prompt batch one step ahead, so generation cannot live in the
data pipeline (it would sample with weights one update old). This callback fills the
batch in place right before ``training_step`` (and ``validation_step``) runs, with
responses from the weights of the latest update, tagged with that policy version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from torch import Tensor

from gspo_lightning.rollout.engine import Generation, RolloutEngine, SamplingParams
from gspo_lightning.rollout.hf import left_pad


@dataclass
class Rollout:
    """One step's responses, as tensors on the module's device.

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
    prompts: list[str] = field(repr=False)
    completions: list[str] = field(repr=False)
    timings: dict[str, float] = field(default_factory=dict)
    reward_errors: int = 0

    @property
    def num_responses(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> Tensor:
        return self.response_mask.sum(-1)


def build_rollout(
    prompt_ids: list[list[int]],
    generation: Generation,
    group_size: int,
    pad_token_id: int,
    device: torch.device,
) -> dict[str, Any]:
    """Tensors of a rollout from prompts and an engine's generation."""
    expanded = [p for p in prompt_ids for _ in range(group_size)]
    prompt_tensor, prompt_mask = left_pad(expanded, pad_token_id, device)
    response_mask = generation.mask.to(device)
    completion_ids = generation.completion_ids.to(device).masked_fill(~response_mask, pad_token_id)
    return {
        "input_ids": torch.cat([prompt_tensor, completion_ids], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask.long()], dim=1),
        "prompt_width": prompt_tensor.shape[1],
        "response_mask": response_mask,
        "engine_logprobs": generation.logprobs.to(device=device, dtype=torch.float32).masked_fill(~response_mask, 0.0),
        "truncated": generation.truncated.to(device),
    }


class RolloutCallback(L.Callback):
    """Runs the module's engine and reward functions before each train / validation batch.

    The module provides ``engine``, ``reward_composer``, ``tokenizer``, ``policy``,
    ``policy_version``, ``rollout_steps`` and the sampling settings; the callback only
    orchestrates, so engines and rewards stay swappable.
    """

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch: dict, batch_idx: int) -> None:
        hp = pl_module.hparams
        params = SamplingParams(hp.response_length, hp.temperature, hp.top_p, hp.top_k)
        seed = pl_module.sampling_seed(pl_module.rollout_steps)
        batch["rollout"] = self.rollout(pl_module, batch, hp.num_return_sequences_in_group, params, seed)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_rollout(pl_module, batch, batch_idx)

    def on_test_batch_start(self, trainer: L.Trainer, pl_module, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_rollout(pl_module, batch, batch_idx)

    def _eval_rollout(self, pl_module, batch: dict, batch_idx: int) -> None:
        hp = pl_module.hparams
        params = SamplingParams(hp.response_length, hp.val_temperature, hp.top_p if hp.val_temperature > 0 else 1.0,
                                hp.top_k if hp.val_temperature > 0 else 0)
        seed = pl_module.sampling_seed(10_000_000 + batch_idx)
        batch["rollout"] = self.rollout(pl_module, batch, hp.val_num_samples, params, seed)

    @staticmethod
    def rollout(pl_module, batch: dict, group_size: int, params: SamplingParams, seed: int) -> Rollout:
        engine: RolloutEngine = pl_module.engine
        tokenizer = pl_module.tokenizer
        timings = {}

        start = time.perf_counter()
        sync = engine.update_weights(pl_module.policy, pl_module.policy_version)
        timings["time/weight_sync"] = time.perf_counter() - start
        if sync is not None and "bytes" in sync:
            timings["weight_sync/bytes"] = float(sync["bytes"])

        start = time.perf_counter()
        engine.wake()
        generation = engine.generate(batch["prompt_ids"], group_size, params, seed)
        engine.sleep()
        timings["time/generate"] = time.perf_counter() - start

        start = time.perf_counter()
        completions = _decode(tokenizer, generation)
        prompts = [text for text in batch["prompt_text"] for _ in range(group_size)]
        columns = {key: [v for v in values for _ in range(group_size)] for key, values in batch["columns"].items()}
        columns["completion_lengths"] = generation.lengths.tolist()
        composer = pl_module.reward_composer
        errors_before = sum(composer.error_counts.values())
        total, components = composer(prompts, completions, columns)
        timings["time/score"] = time.perf_counter() - start

        device = pl_module.device
        tensors = build_rollout(batch["prompt_ids"], generation, group_size, tokenizer.pad_token_id, device)
        return Rollout(
            **tensors,
            rewards=torch.tensor(total, dtype=torch.float32, device=device),
            reward_components={k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in components.items()},
            group_size=group_size,
            policy_version=engine.weights_version,
            prompts=prompts,
            completions=completions,
            timings=timings,
            reward_errors=sum(composer.error_counts.values()) - errors_before,
        )


def _decode(tokenizer, generation: Generation) -> list[str]:
    ids = generation.completion_ids.tolist()
    lengths = generation.lengths.tolist()
    return tokenizer.batch_decode([row[:n] for row, n in zip(ids, lengths)], skip_special_tokens=True)


__all__ = ["Rollout", "RolloutCallback", "build_rollout"]
