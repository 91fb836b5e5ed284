"""Log-probs of response tokens under a causal LM, without a full-vocabulary logit tensor.

Tokens are scored under the distribution the engine sampled from: temperature-scaled,
top-k / top-p filtered and renormalized (``rollout/sampling.py``).

The decoder runs over each distinct prompt once (rows of a group share it, as in the
engine's prefill) and over every response; only the response positions go through the
output head, a plain linear head through an in-place path that holds one float32
logit-sized buffer (``_HeadLogprobs``). When the response logits are small
(``max_unchunked_bytes``) they are projected in one piece and kept for backward. When they
are large (long responses at a 32k+ vocabulary) the head runs ``chunk_size`` tokens at a
time and backward recomputes each chunk's logits instead of keeping them: one more head
matmul, paid only when the logits would not fit. The head is reached by calling its
module, never by reading its weight, so that sharded weights (FSDP2 units, DeepSpeed ZeRO-3
partitions) are gathered by the module's hooks, once per forward and once per backward.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gspo_lightning.models.hf_cache import cache_kwargs, output_cache, select_cache_rows
from gspo_lightning.models.vision import is_vision_language, never_sample_placeholders, placeholder_token_ids, vision_forward_inputs
from gspo_lightning.rollout.sampling import keep_mask

# Response logits up to this size (float32 bytes, all rows) are projected in one piece and
# kept for backward (e.g. 64 responses x 32 tokens at a 32k vocabulary: 250 MiB).
MAX_UNCHUNKED_BYTES = 256 * 2**20


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as the engine used while sampling."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> tuple[Tensor, Tensor]:
    """``(log-prob of target, entropy)`` per position, in float32, under the sampling distribution.

    With top-k / top-p on, tokens outside the kept set get probability 0 and the rest are
    renormalized; the kept set is a selection (no gradient flows through it), the gradient
    flows through the kept logits. The target itself always counts as kept: it was sampled
    from the engine's kept set, and a boundary token that the trainer's slightly different
    numerics would drop must not get a log-prob of -inf.
    """
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    keep = keep_mask(logits, top_k, top_p)
    if keep is not None:
        keep.scatter_(-1, targets.unsqueeze(-1), True)
        logits = logits.masked_fill(~keep, float("-inf"))
    log_probs = F.log_softmax(logits, dim=-1)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():  # a metric: no graph, and checkpoint recomputation skips it
        plogp = log_probs.exp() * log_probs
        if keep is not None:
            plogp = plogp.masked_fill(~keep, 0.0)  # 0 * -inf
        entropy = -plogp.sum(-1)
    return picked, entropy


def _chunk_log_softmax(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, top_k: int, top_p: float,
                       entropy: Optional[Tensor]) -> Tensor:
    """The float32 log-softmax of ``hidden @ weight.T`` under the sampling distribution, computed
    in place in one logit-sized buffer; fills ``entropy`` (rows,) when given."""
    logits = (hidden @ weight.t()).float()
    if temperature not in (0.0, 1.0):
        logits.div_(temperature)
    keep = keep_mask(logits, top_k, top_p)
    if keep is not None:
        keep.scatter_(-1, targets.unsqueeze(-1), True)  # see token_logprobs
        logits.masked_fill_(~keep, float("-inf"))
    block = max(1, 2**22 // logits.shape[-1])  # rows at a time: temporaries of ~16 MiB
    for start in range(0, logits.shape[0], block):
        log_probs = logits[start:start + block]
        log_probs.sub_(torch.logsumexp(log_probs, dim=-1, keepdim=True))  # the log-softmax, in place
        if entropy is not None:
            plogp = log_probs.exp() * log_probs
            if keep is not None:
                plogp.masked_fill_(~keep[start:start + block], 0.0)  # 0 * -inf
            entropy[start:start + block] = -plogp.sum(-1)
    return logits


def _logit_grad_(log_probs: Tensor, targets: Tensor, grad: Tensor, temperature: float) -> Tensor:
    """``d(sum_i grad_i * log_probs[i, targets_i]) / d logits = grad * (onehot - softmax)``, in place."""
    grad = grad.float()
    grad_logits = log_probs.exp_().mul_(-grad.unsqueeze(-1))
    grad_logits.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1))
    if temperature not in (0.0, 1.0):
        grad_logits.div_(temperature)
    return grad_logits


class _HeadLogprobs(torch.autograd.Function):
    """:func:`token_logprobs` of ``hidden @ weight.T``, ``chunk_size`` rows at a time, holding
    one float32 chunk-of-logits buffer.

    Autograd's path keeps the log-softmax for backward and builds a zero tensor, the
    softmax and the input gradient there (four logit-sized buffers at its peak); here the
    log-softmax is computed in place and turned into the logit gradient in place
    (``g * (onehot - softmax)``). With one chunk the log-softmax is saved for backward
    (which consumes it: backward runs once); with several, backward recomputes each chunk's
    logits instead of keeping them (one more head matmul). The weight is an input of one
    call, so a module hook that gathers it (FSDP2, ZeRO-3) runs once per forward and once
    per backward, not once per chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, top_k, top_p, chunk_size):
        rows = hidden.shape[0]
        chunk_size = min(chunk_size or rows, rows) or 1
        entropy = hidden.new_empty(rows, dtype=torch.float32)
        picked = hidden.new_empty(rows, dtype=torch.float32)
        log_probs = None
        for start in range(0, rows, chunk_size):
            end = start + chunk_size
            log_probs = _chunk_log_softmax(hidden[start:end], weight, targets[start:end], temperature, top_k, top_p,
                                           entropy[start:end])
            picked[start:end] = log_probs.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1)
        ctx.mark_non_differentiable(entropy)
        saved = log_probs if chunk_size >= rows else None  # one chunk: keep it; several: recompute
        ctx.save_for_backward(hidden, weight, targets, saved)
        ctx.settings = (temperature, top_k, top_p, chunk_size)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked, grad_entropy):
        # (a second backward through a one-chunk graph fails torch's saved-tensor version check)
        hidden, weight, targets, saved = ctx.saved_tensors
        temperature, top_k, top_p, chunk_size = ctx.settings
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            h, t = hidden[start:end], targets[start:end]
            log_probs = saved if saved is not None else _chunk_log_softmax(h, weight, t, temperature, top_k, top_p, None)
            grad_logits = _logit_grad_(log_probs, t, grad_picked[start:end], temperature).to(hidden.dtype)
            if want_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if want_weight:
                grad_weight.addmm_(grad_logits.t(), h)
        return grad_hidden, grad_weight, None, None, None, None, None


def _plain_linear(head: nn.Module) -> bool:
    return isinstance(head, nn.Linear) and head.bias is None


def _call_as_forward(module: nn.Module, fn: Callable, *args):
    """``module(*args)`` with ``fn(module, *args)`` as its forward, so that the module's hooks
    run around it: FSDP2 and DeepSpeed ZeRO-3 gather a sharded weight in a forward pre-hook
    (and again for backward), which reading ``module.weight`` outside a call would miss."""
    previous = module.__dict__.get("forward")
    module.forward = functools.partial(fn, module)  # an instance attribute shadows the class's forward
    try:
        return module(*args)
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def head_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, chunk_size: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """:func:`token_logprobs` of ``head(hidden)`` for ``hidden`` ``(rows, H)``, ``chunk_size``
    rows projected to the vocabulary at a time (``None``: all at once).

    The head module is always called (its hooks gather sharded weights). A plain linear head
    takes the lean :class:`_HeadLogprobs` path inside that call; any other head runs per chunk
    under activation checkpointing when chunked."""
    if _plain_linear(head):
        def lean(module, h, t):
            return _HeadLogprobs.apply(h, module.weight, t, temperature, top_k, top_p, chunk_size)

        return _call_as_forward(head, lean, hidden, targets)

    def chunk_fn(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        return token_logprobs(head(h), t, temperature, top_k, top_p)

    if chunk_size is None or chunk_size >= hidden.shape[0]:
        return chunk_fn(hidden, targets)
    use_checkpoint = torch.is_grad_enabled() and hidden.requires_grad
    picked, entropy = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
        lp, ent = checkpoint(chunk_fn, h, t, use_reentrant=False) if use_checkpoint else chunk_fn(h, t)
        picked.append(lp)
        entropy.append(ent)
    return torch.cat(picked), torch.cat(entropy)


def supports_chunked(model: nn.Module) -> bool:
    """The chunked path needs logits == output_head(last hidden state), nothing after it."""
    config = getattr(model, "config", None)
    if config is None or model.get_output_embeddings() is None:
        return False
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            return False
    return True


def response_hidden_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_width: int) -> Tensor:
    """The decoder's last hidden states ``(N, R, H)`` at the positions that predict the ``R``
    response tokens (the last prompt position and every response position but the last).

    Rows of a group share their prompt: the prompt then runs through the decoder once per
    distinct prompt and its keys and values are shared by the group's rows (as the engine's
    prefill does), so backward also runs once per prompt. Gradients are the same as with
    one forward per row; at ``G = 8`` samples of 48-token prompts with 16-token responses
    that is 2.9x fewer decoder tokens."""
    decoder = model.get_decoder()
    shared = _shared_prompts(model, input_ids, attention_mask, prompt_width)
    if shared is not None:
        prompt_ids, prompt_mask, inverse = shared
        out = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
                      use_cache=True)
        cache = output_cache(out)
        if cache is not None and not any(getattr(cache, "is_sliding", None) or []):
            first = out.last_hidden_state[:, -1:].index_select(0, inverse)  # the last prompt position predicts response token 0
            if input_ids.shape[1] == prompt_width + 1:
                return first
            select_cache_rows(cache, inverse)  # differentiable: gradients reach the prompt pass
            rest = decoder(input_ids=input_ids[:, prompt_width:-1], attention_mask=attention_mask[:, :-1],
                           position_ids=position_ids_from_mask(attention_mask)[:, prompt_width:-1],
                           use_cache=True, **cache_kwargs(decoder, cache)).last_hidden_state
            return torch.cat([first, rest], dim=1)
    # every position, also the last (Mixture-of-Experts routing records cover whole rows)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
    return hidden[:, prompt_width - 1:-1]  # position t predicts token t + 1


def _shared_prompts(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_width: int):
    """``(prompt_ids, prompt_mask, inverse)`` of the distinct prompts when some rows share one
    (``input_ids[i, :P] == prompt_ids[inverse[i]]``), else ``None``. Not for models whose
    forward must see every row (gradient checkpointing drops the cache; Mixture-of-Experts
    routing is recorded per row)."""
    config = getattr(model, "config", None)
    if config is None or _activation_checkpointing(model):
        return None
    if getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0):
        return None
    key = torch.cat([input_ids[:, :prompt_width], attention_mask[:, :prompt_width].to(input_ids.dtype)], dim=1)
    unique, inverse = torch.unique(key, dim=0, return_inverse=True)
    if unique.shape[0] == key.shape[0]:
        return None
    return unique[:, :prompt_width], unique[:, prompt_width:].to(attention_mask.dtype), inverse


def _activation_checkpointing(model: nn.Module) -> bool:
    if hasattr(type(model), "is_activation_checkpointing"):  # transformers >= 5 (the older name warns)
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def response_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_width: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_size: Optional[int] = 512,
    max_unchunked_bytes: int = MAX_UNCHUNKED_BYTES,
    images: Optional[list] = None,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies ``(N, R)`` of the tokens after the first ``prompt_width``.

    ``input_ids`` is ``[left-padded prompt | right-padded response]``. ``chunk_size`` is
    the number of response tokens projected to the vocabulary at once when the response
    logits exceed ``max_unchunked_bytes``; ``None`` (or a model with logit post-processing)
    takes the plain path through ``model.forward``, as does a vision-language model (``images[i]``:
    row ``i``'s images, ``models/vision.py``).
    """
    targets = input_ids[:, prompt_width:]
    vision = is_vision_language(model)
    if chunk_size is None or vision or not supports_chunked(model):
        if vision:  # the images and M-RoPE positions, computed as the engine computed them
            inputs = vision_forward_inputs(model, input_ids, attention_mask, images or [None] * input_ids.shape[0])
        else:
            inputs = {"input_ids": input_ids, "position_ids": position_ids_from_mask(attention_mask)}
        # logits_to_keep: only the positions that predict response tokens (and the last one)
        width = input_ids.shape[1] - prompt_width + 1
        logits = model(**inputs, attention_mask=attention_mask, use_cache=False, logits_to_keep=width).logits[:, :-1]
        if vision:  # the distribution the engine sampled from: never an image placeholder
            logits = never_sample_placeholders(logits, placeholder_token_ids(model))
        return token_logprobs(logits, targets, temperature, top_k, top_p)

    head = model.get_output_embeddings()
    hidden = response_hidden_states(model, input_ids, attention_mask, prompt_width)
    rows, length, dim = hidden.shape
    # the vocabulary from the module's shape, not its weight (a partitioned weight is empty)
    vocab = getattr(head, "out_features", None) or model.config.vocab_size
    fits = rows * length * vocab * 4 <= max_unchunked_bytes
    picked, entropy = head_logprobs(head, hidden.reshape(rows * length, dim), targets.reshape(rows * length),
                                    temperature, top_k, top_p, chunk_size=None if fits else chunk_size)
    return picked.view(rows, length), entropy.view(rows, length)
