"""Log-probs of response tokens under a causal LM, without a full-vocabulary logit tensor.

The naive path (``model(...).logits`` -> ``log_softmax`` -> gather) holds ``N x T x V``
float32 values at once, several times over in backward: at a 32k vocabulary that is the
largest tensor of a step. The chunked path runs the decoder once, then projects only the
response positions through the output head a chunk of tokens at a time, under activation
checkpointing so backward recomputes each chunk's logits instead of keeping them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as the engine used while sampling."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _token_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """``(log-prob of target, entropy)`` per position, in float32."""
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    log_probs = F.log_softmax(logits, dim=-1)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():  # a metric: no graph, and checkpoint recomputation skips it
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return picked, entropy


def supports_chunked(model: nn.Module) -> bool:
    """The chunked path needs logits == output_head(last hidden state), nothing after it."""
    config = getattr(model, "config", None)
    if config is None or model.get_output_embeddings() is None:
        return False
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            return False
    return True


def response_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_width: int,
    *,
    temperature: float = 1.0,
    chunk_size: Optional[int] = 512,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies ``(N, R)`` of the tokens after the first ``prompt_width``.

    ``input_ids`` is ``[left-padded prompt | right-padded response]``. ``chunk_size`` is
    the number of response tokens projected to the vocabulary at once; ``None`` (or a
    model with logit post-processing) takes the naive path through ``model.forward``.
    """
    position_ids = position_ids_from_mask(attention_mask)
    targets = input_ids[:, prompt_width:]
    if chunk_size is None or not supports_chunked(model):
        # logits_to_keep: only the positions that predict response tokens (and the last one)
        width = input_ids.shape[1] - prompt_width + 1
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False, logits_to_keep=width).logits[:, :-1]
        return _token_logprobs(logits, targets, temperature)

    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=False).last_hidden_state
    hidden = hidden[:, prompt_width - 1:-1]  # position t predicts token t + 1
    rows, length, dim = hidden.shape
    flat_hidden = hidden.reshape(rows * length, dim)
    flat_targets = targets.reshape(rows * length)

    def chunk_fn(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        return _token_logprobs(head(h), t, temperature)

    picked, entropy = [], []
    use_checkpoint = torch.is_grad_enabled() and flat_hidden.requires_grad
    for start in range(0, flat_hidden.shape[0], chunk_size):
        h, t = flat_hidden[start:start + chunk_size], flat_targets[start:start + chunk_size]
        if use_checkpoint:
            lp, ent = checkpoint(chunk_fn, h, t, use_reentrant=False)
        else:
            lp, ent = chunk_fn(h, t)
        picked.append(lp)
        entropy.append(ent)
    return torch.cat(picked).view(rows, length), torch.cat(entropy).view(rows, length)
