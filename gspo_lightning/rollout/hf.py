"""The embedded generation engine: the policy itself, sampled with a lean KV-cached loop.

It shares the training model's weights (no copy, so ``update_weights`` has nothing to
move) and runs on whatever device the policy is on. The loop is written out instead of
calling ``model.generate`` because we need the log-prob of every sampled token and
``generate`` would keep a full-vocabulary score tensor per step to give it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gspo_lightning.rollout.engine import Generation, SamplingParams


def left_pad(sequences: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(ids, attention_mask)`` with every sequence right-aligned."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq):] = 1
    return ids.to(device), mask.to(device)


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k / nucleus to -inf (top-k first, as transformers does)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class HFEngine:
    """Samples from a Hugging Face causal LM in place."""

    def __init__(
        self,
        model: nn.Module,
        eos_token_ids: list[int],
        pad_token_id: int,
        generation_batch_size: Optional[int] = None,
        all_finished: Optional[Callable[[bool], bool]] = None,
    ):
        """``all_finished(local_done) -> global_done`` keeps ranks of a sharded model decoding
        in lockstep (each forward all-gathers weights); ``None`` stops as soon as this rank is done."""
        self.model = model
        self.all_finished = all_finished
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.generation_batch_size = generation_batch_size
        self.weights_version = -1

    def update_weights(self, policy: nn.Module, version: int) -> Optional[dict[str, float]]:
        # Same module object as the policy: its weights are always current.
        self.model = policy
        if version == self.weights_version:
            return None
        self.weights_version = version
        return {"seconds": 0.0, "bytes": 0.0}

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams, seed: int) -> Generation:
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        device = next(self.model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        # chunks hold whole groups: generation_batch_size responses -> that many // n prompts
        per_chunk = max(1, (self.generation_batch_size or len(prompt_ids) * n) // n)
        parts = [self._sample_groups(prompt_ids[i:i + per_chunk], n, params, generator, device)
                 for i in range(0, len(prompt_ids), per_chunk)]
        return _concat(parts, self.pad_token_id)

    @torch.no_grad()
    def _sample_groups(self, prompts: list[list[int]], n: int, params: SamplingParams, generator: torch.Generator, device) -> Generation:
        """``n`` samples of each prompt. The prompt is prefilled once and its KV cache copied to
        the ``n`` samples, instead of prefilling every prompt ``n`` times."""
        model = self.model
        was_training = model.training
        model.eval()
        try:
            input_ids, attention_mask = left_pad(prompts, self.pad_token_id, device)
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            if n > 1:
                cache.batch_repeat_interleave(n)
            logits = out.logits[:, -1, :].float().repeat_interleave(n, dim=0)
            attention_mask = attention_mask.repeat_interleave(n, dim=0)
            position_ids = position_ids.repeat_interleave(n, dim=0)
            eos = torch.tensor(self.eos_token_ids, device=device)
            finished = torch.zeros(attention_mask.shape[0], dtype=torch.bool, device=device)
            tokens, logprobs = [], []
            for step in range(params.max_new_tokens):
                token, token_logprob = _sample_step(logits, params, generator)
                token = torch.where(finished, torch.full_like(token, self.pad_token_id), token)
                token_logprob = torch.where(finished, torch.zeros_like(token_logprob), token_logprob)
                tokens.append(token)
                logprobs.append(token_logprob)
                finished = finished | torch.isin(token, eos)
                if step == params.max_new_tokens - 1:
                    break  # no forward after the last token
                done = bool(finished.all())
                if self.all_finished is not None:
                    done = self.all_finished(done)
                if done:
                    break
                attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=-1)
                position_ids = position_ids[:, -1:] + 1
                out = model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                logits = out.logits[:, -1, :].float()
            completion_ids = torch.stack(tokens, dim=1)
            token_logprobs = torch.stack(logprobs, dim=1)
            is_eos = torch.isin(completion_ids, eos)
            has_eos = is_eos.any(-1)
            first_eos = is_eos.float().argmax(-1)
            lengths = torch.where(has_eos, first_eos + 1, torch.full_like(first_eos, completion_ids.shape[1]))
            return Generation(completion_ids, token_logprobs, lengths, truncated=~has_eos)
        finally:
            model.train(was_training)


def _sample_step(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """One token per row and its log-prob under the temperature-scaled distribution.

    The log-prob is taken before top-k/top-p filtering: it must match what the trainer
    recomputes from the same logits (``logprobs.py`` applies the same temperature).
    Sampling inverts the CDF with one uniform draw per row: at a 32k vocabulary
    ``torch.multinomial`` alone was a quarter of a CPU step.
    """
    if params.temperature == 0:
        token = logits.argmax(-1)
        return token, F.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    log_probs = F.log_softmax(scaled, -1)
    if params.top_k > 0 or params.top_p < 1.0:
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
    else:
        probs = log_probs.exp()
    cdf = probs.cumsum(-1)
    u = torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
    # right=True: a token with zero probability (a flat stretch of the CDF) is never picked
    token = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    return token, log_probs.gather(-1, token[:, None]).squeeze(-1)


def _concat(parts: list[Generation], pad_id: int) -> Generation:
    if len(parts) == 1:
        return parts[0]
    width = max(p.completion_ids.shape[1] for p in parts)

    def pad(t: Tensor, value) -> Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=value)

    return Generation(
        completion_ids=torch.cat([pad(p.completion_ids, pad_id) for p in parts]),
        logprobs=torch.cat([pad(p.logprobs, 0.0) for p in parts]),
        lengths=torch.cat([p.lengths for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]),
    )


__all__ = ["HFEngine", "filter_logits", "left_pad"]
