"""What the client engine (``remote.py``) accepts from a rollout server: a reply that is not
what was asked for stops the run with a :class:`~gspo_lightning.errors.RolloutServerError`
naming the server and the first thing wrong, before any of it reaches the trainer.

A generation reply has one row per response (prompts x n), each of 1 to
``max_new_tokens`` token ids below the vocabulary size, as many log-probs, finite and at
most 0 (a log-probability), a ``truncated`` flag per row, and an integer ``version``; a
weights reply names the version and checksum it now holds. The size of a reply is bounded
while it is read (``request_json``'s ``max_bytes``).
"""

from __future__ import annotations

import math
from typing import Any

from gspo_lightning.errors import RolloutServerError

# a sampled token's log-probability is <= 0; engines that renormalize a filtered distribution
# (top-k / top-p) may round a sure token a hair above 0 in float32
LOGPROB_SLACK = 1e-4


def _refuse(url: str, what: str) -> RolloutServerError:
    return RolloutServerError(f"rollout refused: the reply of the rollout server at {url} {what}; is it a gspo serve "
                              "of this version, for this run's model?")


def check_generation_reply(url: str, reply: Any, rows: int, max_new_tokens: int, vocab_size: int) -> dict:
    """``reply`` if it is a well-formed answer of ``rows`` responses, else a refusal."""
    if not isinstance(reply, dict):
        raise _refuse(url, f"is a JSON {type(reply).__name__}, not an object")
    version = reply.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise _refuse(url, f"has version {str(version)[:40]!r}, not an integer")
    if not isinstance(reply.get("checksum"), (str, type(None))):
        raise _refuse(url, "has a checksum that is not a string")
    ids, logprobs, truncated = reply.get("completion_ids"), reply.get("logprobs"), reply.get("truncated")
    for name, value in (("completion_ids", ids), ("logprobs", logprobs), ("truncated", truncated)):
        if not isinstance(value, list) or len(value) != rows:
            got = len(value) if isinstance(value, list) else type(value).__name__
            raise _refuse(url, f"has {got} {name} rows for {rows} responses (prompts x n)")
    for row, (tokens, lps, cut) in enumerate(zip(ids, logprobs, truncated)):
        if not isinstance(tokens, list) or not 1 <= len(tokens) <= max_new_tokens:
            got = len(tokens) if isinstance(tokens, list) else type(tokens).__name__
            raise _refuse(url, f"has a response (row {row}) of {got} tokens; asked for 1 to {max_new_tokens}")
        if not isinstance(lps, list) or len(lps) != len(tokens):
            raise _refuse(url, f"has {len(lps) if isinstance(lps, list) else 'no'} log-probs for the {len(tokens)} "
                               f"tokens of row {row}")
        if not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
            raise _refuse(url, f"has a token id outside [0, {vocab_size}) (the model's vocabulary) in row {row}")
        if not all(type(v) in (int, float) and math.isfinite(v) and v <= LOGPROB_SLACK for v in lps):
            raise _refuse(url, f"has a log-prob that is not a finite number <= 0 in row {row}")
        if not isinstance(cut, bool):
            raise _refuse(url, f"has truncated {str(cut)[:20]!r} in row {row}, not true / false")
    return reply


def check_weights_reply(url: str, reply: Any) -> dict:
    """``reply`` if it names the ``version`` and ``checksum`` loaded and finite ``seconds``."""
    if not isinstance(reply, dict):
        raise _refuse(url, f"to a weights push is a JSON {type(reply).__name__}, not an object")
    seconds = reply.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        raise _refuse(url, "to a weights push has no finite seconds")
    return reply


__all__ = ["LOGPROB_SLACK", "check_generation_reply", "check_weights_reply"]
