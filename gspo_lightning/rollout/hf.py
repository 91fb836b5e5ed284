"""The embedded generation engine: the policy itself, sampled with a lean KV-cached loop.

It shares the training model's weights (no copy, so there is nothing to push after an
update) and runs on whatever device the policy is on. The loop is written out instead of
calling ``model.generate`` because we need the log-prob of every sampled token and
``generate`` would keep a full-vocabulary score tensor per step to give it. Llama-family
models decode over a preallocated KV cache (``kv_decode.py``); others through their own
forward and ``DynamicCache``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gspo_lightning.errors import ConfigError
from gspo_lightning.models.hf_cache import cache_kwargs, output_cache
from gspo_lightning.models.vision import (ImageInputs, is_vision_language, never_sample_placeholders, placeholder_token_ids,
                                          vision_forward_inputs)
from gspo_lightning.rollout import kv_decode, stop
from gspo_lightning.rollout.engine import EngineSpec, Generation, RolloutEngine, SamplingParams
from gspo_lightning.rollout.phases import PHASES
from gspo_lightning.rollout.sampling import filter_logits


def left_pad(sequences: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(ids, attention_mask)`` with every sequence right-aligned (one tensor built from lists)."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    return ids.to(device), mask.to(device)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` made units (empty when unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[bool]:
    """Every FSDP2 unit of ``model`` (laid out by ``training/sharding.py``) unsharded for the
    whole block (full weights on every rank, as under DDP), so that a decode loop's forwards
    gather nothing; resharded after. Yields whether the model was sharded. Inside the block no
    forward runs a collective, so ranks need not decode in lockstep."""
    units = fsdp_units(model)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield bool(units)
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)


# generation_batch_size: null samples as many responses at once as keep their KV cache within this
KV_CACHE_BUDGET_BYTES = 4 * 2**30


class HFEngine(RolloutEngine):
    """Samples from the training model itself (``model.engine`` default).

    Args:
        generation_batch_size: responses sampled at once, rounded down to whole groups (at
            least one); a memory knob. ``null``: as many as keep the KV cache (prompt plus
            ``max_new_tokens`` per response) within 4 GiB, all of the step's for small models.
    """

    shares_policy_weights = True  # the same module object as the policy: always current
    takes_images = True  # a vision-language policy's prompts carry their images (``generate(images=...)``)

    def __init__(self, generation_batch_size: Optional[int] = None):
        super().__init__()
        if generation_batch_size is not None and generation_batch_size < 1:
            raise ConfigError(f"generation_batch_size must be >= 1 or null, got {generation_batch_size}")
        self.generation_batch_size = generation_batch_size
        self.model: Optional[nn.Module] = None
        self.eos_token_ids: list[int] = []
        self.pad_token_id = 0
        self.all_finished: Optional[Callable[[bool], bool]] = None

    def start(self, spec: EngineSpec) -> None:
        if spec.policy is None:
            raise ConfigError("HFEngine samples from the policy itself: EngineSpec.policy must be the training model")
        self.model = spec.policy
        self.eos_token_ids = list(spec.eos_token_ids)
        self.pad_token_id = spec.pad_token_id
        # sharded weights are gathered in every forward: all ranks must take as many decode steps
        self.all_finished = spec.lockstep

    def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams, seed: int,
                 on_group: Optional[GroupDone] = None, images: Optional[list[Optional[ImageInputs]]] = None) -> Generation:
        """``n`` responses to each prompt; ``on_group(index, completions)`` is called as each group's
        responses have all ended (their token ids up to and including the end token), while the
        others still generate: their scoring can start (``rollout/scoring.py``). ``images[i]``:
        prompt ``i``'s images (``models/vision.py``), for a vision-language policy."""
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ConfigError("every prompt needs at least one token")
        if images is not None and not is_vision_language(self.model):
            raise ConfigError(f"the prompts have images, but the policy ({type(self.model).__name__}) is a text model: "
                              "use a vision-language model, or drop the data's images column")
        device = next(self.model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        # chunks hold whole groups: generation_batch_size responses -> that many // n prompts
        per_chunk = max(1, (self.generation_batch_size or self._responses_in_budget(prompt_ids, params)) // n)
        # FSDP2: gather the weights once for the whole call, not in every decoded token's forward
        with gathered(self.model) as sharded:
            parts = [self._sample_groups(prompt_ids[i:i + per_chunk], n, params, generator, device, lockstep=not sharded,
                                         on_group=None if on_group is None else _offset(on_group, i),
                                         images=None if images is None else images[i:i + per_chunk])
                     for i in range(0, len(prompt_ids), per_chunk)]
        return _concat(parts, self.pad_token_id)

    def _responses_in_budget(self, prompt_ids: list[list[int]], params: SamplingParams) -> int:
        """Responses whose KV cache fits :data:`KV_CACHE_BUDGET_BYTES` (no limit when the
        model's shape is unknown)."""
        dtype = next(self.model.parameters()).dtype
        per_token = kv_decode.kv_cache_bytes_per_token(self.model.config, dtype)
        if not per_token:
            return 1 << 62
        return KV_CACHE_BUDGET_BYTES // (per_token * (max(len(p) for p in prompt_ids) + params.max_new_tokens))

    def _sample_groups(self, prompts: list[list[int]], n: int, params: SamplingParams, generator: torch.Generator, device,
                       lockstep: bool = True, on_group: Optional[GroupDone] = None,
                       images: Optional[list[Optional[ImageInputs]]] = None) -> Generation:
        """``n`` samples of each prompt. The prompt is prefilled once and its KV cache copied to
        the ``n`` samples, instead of prefilling every prompt ``n`` times."""
        with _grad_free_mode(self.model, sharded=self.all_finished is not None):
            out = self._sample_groups_grad_free(prompts, n, params, generator, device, lockstep, on_group, images)
        # ordinary tensors again: the trainer saves the tokens for backward and edits results in place
        return Generation(*(t.clone() for t in (out.completion_ids, out.logprobs, out.lengths, out.truncated)))

    def _sample_groups_grad_free(self, prompts: list[list[int]], n: int, params: SamplingParams,
                               generator: torch.Generator, device, lockstep: bool = True,
                               on_group: Optional[GroupDone] = None,
                               images: Optional[list[Optional[ImageInputs]]] = None) -> Generation:
        model = self.model
        was_training = model.training
        model.eval()
        try:
            input_ids, attention_mask = left_pad(prompts, self.pad_token_id, device)
            if is_vision_language(model):  # the images, and M-RoPE positions (the trainer computes the same)
                inputs = vision_forward_inputs(model, input_ids, attention_mask, images or [None] * len(prompts))
                position_ids = inputs["position_ids"]
            else:
                position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
                inputs = {"input_ids": input_ids, "position_ids": position_ids}
            out = model(**inputs, attention_mask=attention_mask, use_cache=True, logits_to_keep=1)
            # a vision-language policy never samples an image placeholder (the trainer scores the same way)
            placeholders = placeholder_token_ids(model) if is_vision_language(model) else []
            logits = never_sample_placeholders(out.logits[:, -1, :].float(), placeholders).repeat_interleave(n, dim=0)
            feeds = params.max_new_tokens - 1  # no forward after the last token
            if kv_decode.supports(model):
                decoder = kv_decode.KVDecoder(model, output_cache(out), attention_mask, n, feeds)
            else:
                decoder = _CacheDecoder(model, output_cache(out), attention_mask, position_ids, n)
            rows = logits.shape[0]
            eos = torch.tensor(self.eos_token_ids, device=device)
            completion_ids = torch.full((rows, params.max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
            token_logprobs = torch.zeros((rows, params.max_new_tokens), dtype=torch.float32, device=device)
            finished = torch.zeros(rows, dtype=torch.bool, device=device)
            pad = torch.full((rows,), self.pad_token_id, dtype=torch.long, device=device)
            width = 0
            groups = _GroupWatch(on_group, n, eos) if on_group is not None else None
            for step in range(params.max_new_tokens):
                token, token_logprob = _sample_step(logits, params, generator)
                token = torch.where(finished, pad, token)
                completion_ids[:, step] = token
                token_logprobs[:, step] = token_logprob.masked_fill_(finished, 0.0)
                width = step + 1
                PHASES.tokens(width, params.max_new_tokens)  # the progress display's "token 12/32"
                stop.check()  # SIGTERM / Ctrl-C: this step's samples would be thrown away
                finished |= torch.isin(token, eos)
                if groups is not None:
                    groups.report(finished, completion_ids[:, :width])
                if step == feeds:
                    break
                done = bool(finished.all())
                if self.all_finished is not None and lockstep:  # gathered weights need no lockstep
                    done = self.all_finished(done)
                if done:
                    break
                logits = never_sample_placeholders(decoder.step(token), placeholders)
            completion_ids, token_logprobs = completion_ids[:, :width], token_logprobs[:, :width]
            if groups is not None:  # the groups cut by the token budget
                groups.report(torch.ones_like(finished), completion_ids)
            is_eos = torch.isin(completion_ids, eos)
            has_eos = is_eos.any(-1)
            first_eos = is_eos.float().argmax(-1)
            lengths = torch.where(has_eos, first_eos + 1, torch.full_like(first_eos, completion_ids.shape[1]))
            return Generation(completion_ids, token_logprobs, lengths, truncated=~has_eos)
        finally:
            model.train(was_training)


def _grad_free_mode(model: nn.Module, sharded: bool):
    """``inference_mode`` where it is safe, else ``no_grad``. ``inference_mode`` skips
    autograd's version counters and view tracking on every op (~6% of a small model's decode
    step). Hooked models (DeepSpeed ZeRO-3 gathering, MoE routing records) and sharded ones
    create tensors in a forward that must stay ordinary for the next training forward."""
    hooked = any(kv_decode.has_forward_hooks(m) for m in model.modules())
    return torch.no_grad() if hooked or sharded else torch.inference_mode()


class _CacheDecoder:
    """Decode steps through the model's own forward and ``DynamicCache`` (any causal LM)."""

    def __init__(self, model: nn.Module, cache, attention_mask: Tensor, position_ids: Tensor, repeat: int):
        if repeat > 1:
            cache.batch_repeat_interleave(repeat)
        self.model, self.cache = model, cache
        self.attention_mask = attention_mask.repeat_interleave(repeat, dim=0)
        # (rows, length), or M-RoPE's (3, rows, length): each row goes on from its last position
        self.position_ids = position_ids[..., -1:].repeat_interleave(repeat, dim=-2)

    def step(self, tokens: Tensor) -> Tensor:
        self.attention_mask = torch.cat([self.attention_mask, torch.ones_like(self.attention_mask[:, :1])], dim=-1)
        self.position_ids = self.position_ids + 1
        out = self.model(input_ids=tokens[:, None], attention_mask=self.attention_mask, position_ids=self.position_ids,
                         use_cache=True, logits_to_keep=1, **cache_kwargs(self.model, self.cache))
        self.cache = output_cache(out)
        return out.logits[:, -1, :].float()


def _sample_step(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """One token per row and its log-prob under the sampling distribution: the
    temperature-scaled logits, top-k / top-p filtered and renormalized (the trainer scores
    under the same distribution, ``training/logprobs.py``)."""
    if params.temperature == 0:
        token = logits.argmax(-1)
        return token, F.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    scaled = filter_logits(scaled, params.top_k, params.top_p)
    top = scaled.amax(-1, keepdim=True)
    weights = (scaled - top).exp_()  # unnormalized probabilities, 0 where filtered out
    token, total = draw(weights, generator)
    picked = scaled.gather(-1, token[:, None]).squeeze(-1) - top.squeeze(-1)
    return token, picked - total.log().to(picked.dtype)


_ONE_LEVEL_MAX = 1024  # up to this vocabulary the float64 cumulative sum of the whole row is cheap


def draw(weights: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Index ``i`` of each row with probability ``weights[i] / weights.sum()``, and the row sums.

    Exact to float64 resolution: a float32 cumulative sum over the whole vocabulary cannot
    resolve tokens below ~6e-8 of the mass (at a 152k vocabulary they add up to ~7e-4 of
    total variation). Large vocabularies take two levels instead: a block from the float64
    cumulative sum of block sums, then an entry from the float64 cumulative sum of that block
    alone. Blocks are ~sqrt(vocabulary) wide (a power of two), so both cumulative sums are
    short; the only full-vocabulary pass is the float32 block sum (``torch.multinomial``
    draws an exponential variate per entry, ~40x slower at a 32k vocabulary, and a float64
    cumulative sum of the whole row ~5x). One uniform number per row from ``generator``.
    """
    rows, vocab = weights.shape
    if vocab <= _ONE_LEVEL_MAX:
        ends = weights.double().cumsum(-1)
        total = ends[:, -1:]
        return torch.searchsorted(ends, _uniform_below(total, generator), right=True).squeeze(-1), total.squeeze(-1)
    width = 1 << math.ceil(math.log2(vocab) / 2)
    count = -(-vocab // width)
    if count * width != vocab:  # zero weights after the last entry: never drawn
        weights = F.pad(weights, (0, count * width - vocab))
    blocks = weights.view(rows, count, width)
    mass = blocks.sum(-1).double()  # (rows, count)
    ends = mass.cumsum(-1)
    total = ends[:, -1:]
    u = _uniform_below(total, generator)
    # right=True: the first block ending after u, so never a block without mass
    block = torch.searchsorted(ends, u, right=True)
    block_mass = mass.gather(-1, block)
    frac = ((u - (ends.gather(-1, block) - block_mass)) / block_mass).clamp_(0.0, 1.0)  # where u falls in it
    within = blocks.gather(1, block[:, :, None].expand(rows, 1, width)).squeeze(1).double().cumsum(-1)
    within_total = within[:, -1:]
    target = torch.minimum(frac * within_total, torch.nextafter(within_total, torch.zeros_like(within_total)))
    offset = torch.searchsorted(within, target, right=True).squeeze(-1)
    return block.squeeze(-1) * width + offset, total.squeeze(-1)


def _uniform_below(total: Tensor, generator: torch.Generator) -> Tensor:
    """One float64 draw per row, uniform in ``[0, total)`` (strictly below, even after rounding)."""
    u = torch.rand(total.shape, generator=generator, device=total.device, dtype=torch.float64) * total
    return torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))


# on_group(index of the group in the call, each response's token ids up to its end token)
GroupDone = Callable[[int, list[list[int]]], None]


def _offset(on_group: GroupDone, first: int) -> GroupDone:
    """``on_group`` for a chunk of the call's prompts starting at prompt ``first``."""
    return lambda index, completions: on_group(first + index, completions)


class _GroupWatch:
    """Reports each group once, when every one of its responses has ended."""

    def __init__(self, on_group: GroupDone, n: int, eos: Tensor):
        self.on_group, self.n, self.eos = on_group, n, eos
        self.reported: Optional[Tensor] = None

    def report(self, finished: Tensor, completion_ids: Tensor) -> None:
        done = finished.view(-1, self.n).all(-1)
        if self.reported is None:
            self.reported = torch.zeros_like(done)
        new = (done & ~self.reported).nonzero().flatten().tolist()
        if not new:
            return
        self.reported[new] = True
        for group in new:
            rows = completion_ids[group * self.n:(group + 1) * self.n]
            is_eos = torch.isin(rows, self.eos)
            ends = torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, rows.shape[1]).tolist()
            self.on_group(group, [row[:end] for row, end in zip(rows.tolist(), ends)])


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


__all__ = ["HFEngine", "draw", "filter_logits", "left_pad"]
