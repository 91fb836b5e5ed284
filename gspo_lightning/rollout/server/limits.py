"""What a request may ask of a rollout server: :class:`ServerLimits` (set by ``gspo serve``
options), and the checks that turn a request's JSON body into typed arguments, or refuse it
with a :class:`BadRequest` that names the field and the limit.

The HTTP layer (``http.py``) enforces the limits on connections and bodies; the checks here
are of what a well-formed body asks for: how many prompts, responses and tokens, and
sampling parameters that are finite numbers. A trainer never comes near the defaults.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any, Optional

from gspo_lightning.errors import ConfigError
from gspo_lightning.rollout.engine import SamplingParams


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400 or ``status``), with a reason for the client."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what a client can make a rollout server hold or compute.

    Args:
        request_timeout_s: a request's line, headers and body must arrive within this long
            (a half-sent request is dropped); also the socket timeout of every read.
        reply_timeout_s: longest time to send one reply (a client that stops reading is
            dropped); a large generation's reply over a slow link needs a while.
        max_connections: connections served at once; more are answered 503 and closed.
        max_body_mb: largest request body (``Content-Length`` is checked before reading).
        max_prompts: prompts per generation request.
        max_prompt_tokens: tokens per prompt.
        max_n: responses per prompt.
        max_responses: responses per request (prompts x n).
        max_new_tokens: new tokens per response; ``None``: the server's ``response_length``.
    """

    request_timeout_s: float = 10.0
    reply_timeout_s: float = 300.0
    max_connections: int = 32
    max_body_mb: float = 64.0
    max_prompts: int = 4096
    max_prompt_tokens: int = 32768
    max_n: int = 256
    max_responses: int = 65536
    max_new_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "reply_timeout_s", "max_body_mb"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"server limit {name} must be a finite number > 0, got {value!r}")
        for name in ("max_connections", "max_prompts", "max_prompt_tokens", "max_n", "max_responses", "max_new_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_new_tokens":
                continue
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"server limit {name} must be an integer >= 1, got {value!r}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)


# -- fields -----------------------------------------------------------------------------------
def integer(body: dict, key: str, low: int, high: int, what: str = "") -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise BadRequest(f"{key}={value} is outside [{low}, {high}]{what}")
    return value


def finite(params: dict, key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"params.{key} must be a finite number, got {value!r}")
    return float(value)


def session_token(body: dict) -> str:
    """The session token (which trainer holds the server: ``lease.py``), a short string."""
    token = body.get("token")
    if not isinstance(token, str) or not 0 < len(token) <= 128:
        raise BadRequest("token must be the session's token, a string of 1 to 128 characters (POST /session first)")
    return token


def json_object(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise BadRequest(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


# -- requests ---------------------------------------------------------------------------------
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k"}
SEED_RANGE = (0, 2**63 - 1)


def generation_request(body: dict, limits: ServerLimits, vocab_size: int, response_length: int) -> dict:
    """``POST /generate``'s arguments, checked: ``token``, ``prompt_ids``, ``n``, ``params``
    (a :class:`SamplingParams`), ``seed``, ``version``."""
    prompts = body.get("prompt_ids")
    if not isinstance(prompts, list) or not prompts:
        raise BadRequest("prompt_ids must be a non-empty list of prompts (lists of token ids)")
    n = integer(body, "n", 1, limits.max_n, " (gspo serve --max_n)")
    check_prompts(prompts, n, limits, vocab_size)
    params = json_object(body.get("params"), "params")
    unknown = set(params) - SAMPLING_KEYS
    if unknown:
        raise BadRequest(f"unknown sampling parameters {sorted(unknown)}; known: {sorted(SAMPLING_KEYS)}")
    sampling = sampling_params(params, params.get("max_new_tokens"), params.get("top_k", 0), limits, vocab_size,
                               response_length)
    version = body.get("version")
    if version is not None:
        version = integer(body, "version", -1, 2**62)
    return {"token": session_token(body), "prompt_ids": prompts, "n": n, "params": sampling,
            "seed": integer(body, "seed", *SEED_RANGE), "version": version}


def check_prompts(prompts: list, n: int, limits: ServerLimits, vocab_size: int) -> None:
    """Prompts as lists of token ids, within the server's counts and vocabulary."""
    if len(prompts) > limits.max_prompts:
        raise BadRequest(f"{len(prompts)} prompts in one request; this server takes at most {limits.max_prompts} "
                         "(gspo serve --max_prompts)")
    for prompt in prompts:
        if not isinstance(prompt, list) or not 0 < len(prompt) <= limits.max_prompt_tokens:
            raise BadRequest(f"every prompt must be a list of 1 to {limits.max_prompt_tokens} token ids "
                             "(gspo serve --max_prompt_tokens)")
        # type() is exact: bool is an int subclass, and True is no token id
        if not all(type(t) is int and 0 <= t < vocab_size for t in prompt):
            raise BadRequest(f"token ids must be integers in [0, {vocab_size}) (this model's vocabulary)")
    if len(prompts) * n > limits.max_responses:
        raise BadRequest(f"{len(prompts)} prompts x n={n} responses exceed this server's {limits.max_responses} "
                         "per request (gspo serve --max_responses)")


def sampling_params(params: dict, max_new_tokens: Any, top_k: Any, limits: ServerLimits, vocab_size: int,
                    response_length: int) -> SamplingParams:
    longest = limits.max_new_tokens or response_length
    return SamplingParams(
        max_new_tokens=integer({"max_new_tokens": max_new_tokens}, "max_new_tokens", 1, longest,
                               " (the server's response_length, or gspo serve --max_new_tokens)"),
        temperature=finite(params, "temperature", 1.0), top_p=finite(params, "top_p", 1.0),
        top_k=integer({"top_k": top_k}, "top_k", 0, vocab_size),
    )  # SamplingParams checks the ranges (temperature >= 0, top_p in (0, 1])


# what a completion request of vLLM's API may hold here (StockVLLMEngine's, an OpenAI client's):
# anything else would change the samples in a way this server does not, so it is refused by name
COMPLETION_KEYS = {"model", "prompt", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs",
                   "return_token_ids", "stop_token_ids", "ignore_eos", "skip_special_tokens", "stream", "echo", "user",
                   # vllm-router adds these (false) to every completion it forwards
                   "no_stop_trim", "return_hidden_states"}


def completion_request(body: dict, limits: ServerLimits, vocab_size: int, response_length: int,
                       eos_token_ids: list[int]) -> dict:
    """``POST /v1/completions`` (vLLM's API, prompts as token ids) as ``prompt_ids``, ``n``,
    ``params``, ``seed`` for the engine; ``logprobs`` whether they are asked for."""
    unknown = set(body) - COMPLETION_KEYS
    if unknown:
        raise BadRequest(f"this server does not take {sorted(unknown)} in a completion request (it takes "
                         f"{sorted(COMPLETION_KEYS)})")
    if body.get("stream") or body.get("echo"):
        raise BadRequest("this server does not stream or echo completions: send stream and echo false")
    if body.get("return_hidden_states"):
        raise BadRequest("this server returns no hidden states: send return_hidden_states false")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = prompt
    else:
        raise BadRequest("prompt must be token ids (a list of integers, or a list of such lists): this server reads "
                         "no text, so nothing is tokenized twice")
    n = integer({"n": body.get("n", 1)}, "n", 1, limits.max_n, " (gspo serve --max_n)")
    check_prompts(prompts, n, limits, vocab_size)
    top_k = body.get("top_k", 0)
    top_k = 0 if top_k in (None, -1) else top_k  # vLLM's "no top-k" is -1 (or 0)
    params = {key: body[key] for key in ("temperature", "top_p") if body.get(key) is not None}
    max_tokens = body.get("max_tokens")
    sampling = sampling_params(params, limits.max_new_tokens or response_length if max_tokens is None else max_tokens,
                               top_k, limits, vocab_size, response_length)
    stops = set(body.get("stop_token_ids") or [])
    if not body.get("ignore_eos"):
        stops |= set(eos_token_ids)
    if stops != set(eos_token_ids):
        raise BadRequest(f"this server's samples end at its model's EOS tokens {sorted(eos_token_ids)} and nowhere else: "
                         f"send stop_token_ids {sorted(eos_token_ids)} (or none), not {sorted(stops)[:20]}")
    seed = body.get("seed")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1):
        raise BadRequest("logprobs must be 0 (the sampled token's log-prob) or null: this server returns no top-k "
                         "alternatives")
    return {"prompt_ids": prompts, "n": n, "params": sampling,
            # no seed: a fresh one, as vLLM draws (two unseeded calls must not return the same samples)
            "seed": integer({"seed": secrets.randbelow(SEED_RANGE[1]) if seed is None else seed}, "seed", *SEED_RANGE),
            "logprobs": logprobs is not None}


def weights_request(body: dict) -> dict:
    """``POST /weights``'s arguments: ``token``, ``version``, ``manifest`` (its transport
    checks the rest)."""
    manifest = json_object(body.get("manifest"), "manifest")
    if not isinstance(manifest.get("kind"), str):
        raise BadRequest("manifest.kind must name a weight transport")
    return {"token": session_token(body), "version": integer(body, "version", 0, 2**62), "manifest": manifest}


__all__ = ["BadRequest", "ServerLimits", "completion_request", "generation_request", "weights_request"]
