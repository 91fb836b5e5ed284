"""The part of vLLM's serving API that ``StockVLLMEngine`` drives, answered by ``gspo serve``:
one client for stock ``vllm serve`` processes and for our server (the HF engine, on machines
without vLLM). Same paths, bodies and replies as vLLM 0.32; what differs is said here.

=================================  ========================================================
``GET /v1/models``                 the served model, ``owned_by: gspo-lightning`` (a client
                                   may send several prompts in one request to us), and
                                   ``max_model_len`` (the longest prompt + response)
``POST /v1/completions``           prompts as token ids (one, or a list), ``n``,
                                   ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
                                   ``seed``, ``logprobs: 0``, ``return_token_ids``: each
                                   choice's ``token_ids``, ``logprobs.token_logprobs`` (of the
                                   distribution sampled, as vLLM's ``processed_logprobs``),
                                   ``finish_reason``; ``stop_token_ids`` must be the model's EOS
``GET /is_paused``                 ``{"is_paused": bool}``
``POST /pause?mode=wait|keep``     new generations wait (up to the server's
                                   ``version_wait_s``); returns once the one in flight ended.
                                   ``mode=abort`` is refused: a generation is never cut short
``POST /resume``                   generations go on
``POST /collective_rpc``           ``{"method": "reload_weights", "kwargs": {"weights_path":
                                   DIR}}``: the safetensors files in DIR, a folder under the
                                   server's weights root written by its own user (no other
                                   method is served)
``POST /update_weight_version``    ``{"new_version": "7"}``: the version the replies carry
``POST /reset_prefix_cache``       nothing cached here across requests: ``{}``
=================================  ========================================================

Unlike vLLM, every route needs the server's secret (``Authorization: Bearer``; vLLM
authenticates only its OpenAI routes), a request holds no session (``/session`` is the
``RemoteEngine``'s protocol), and the limits of ``limits.py`` apply to every request.
"""

from __future__ import annotations

import time
import uuid

from gspo_lightning.rollout.server.host import RolloutServer
from gspo_lightning.rollout.server.limits import BadRequest, completion_request

OWNER = "gspo-lightning"  # what /v1/models says owns the model: a client may batch prompts to us


def max_model_len(app: RolloutServer) -> int:
    return app.limits.max_prompt_tokens + (app.limits.max_new_tokens or app.spec.response_length)


def models(app: RolloutServer, body: dict, query: dict) -> dict:
    return {"object": "list", "data": [{"id": app.spec.model_name_or_path, "object": "model", "owned_by": OWNER,
                                        "created": 0, "max_model_len": max_model_len(app)}]}


def completions(app: RolloutServer, body: dict, query: dict) -> dict:
    model = body.get("model")
    if model is not None and model != app.spec.model_name_or_path:
        raise BadRequest(f"this server serves {app.spec.model_name_or_path!r}, not {str(model)[:200]!r}", status=404)
    request = completion_request(body, app.limits, app.vocab_size, app.spec.response_length,
                                 app.identity["eos_token_ids"])
    generation, version, _ = app.sample(request["prompt_ids"], request["n"], request["params"], request["seed"])
    lengths = generation.lengths.tolist()
    ids = [row[:k] for row, k in zip(generation.completion_ids.tolist(), lengths)]
    logprobs = [row[:k] for row, k in zip(generation.logprobs.tolist(), lengths)]
    choices = []
    for index, (tokens, values, cut) in enumerate(zip(ids, logprobs, generation.truncated.tolist())):
        choices.append({"index": index, "text": app.tokenizer.decode(tokens, skip_special_tokens=False),
                        "token_ids": tokens, "finish_reason": "length" if cut else "stop",
                        "logprobs": {"token_logprobs": values} if request["logprobs"] else None})
    prompt_tokens = sum(len(p) for p in request["prompt_ids"]) * request["n"]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": app.spec.model_name_or_path, "choices": choices, "weight_version": str(version),
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": sum(lengths),
                      "total_tokens": prompt_tokens + sum(lengths)}}


def is_paused(app: RolloutServer, body: dict, query: dict) -> dict:
    return {"is_paused": app.paused}


def pause(app: RolloutServer, body: dict, query: dict) -> dict:
    mode = query.get("mode", "abort")  # vLLM's default
    if mode not in ("wait", "keep"):
        raise BadRequest(f"pause mode {str(mode)[:40]!r}: this server never cuts a generation short; use mode=wait "
                         "(or keep: the same here)")
    app.pause()
    return {"status": "paused"}


def resume(app: RolloutServer, body: dict, query: dict) -> dict:
    app.resume()
    return {"status": "resumed"}


def collective_rpc(app: RolloutServer, body: dict, query: dict) -> dict:
    method, kwargs = body.get("method"), body.get("kwargs") or {}
    if method != "reload_weights" or not isinstance(kwargs, dict) or set(kwargs) != {"weights_path"}:
        raise BadRequest("this server runs one collective_rpc: {\"method\": \"reload_weights\", \"kwargs\": "
                         "{\"weights_path\": <a folder of safetensors under its weights root>}}")
    return {"results": [app.reload_folder(kwargs["weights_path"])]}


def update_weight_version(app: RolloutServer, body: dict, query: dict) -> dict:
    version = body.get("new_version")
    if not (isinstance(version, str) and version.isdigit() and len(version) < 19) and \
            not (type(version) is int and 0 <= version < 2**62):
        raise BadRequest(f"new_version must be a whole number (as a string or an integer), got {str(version)[:40]!r}")
    app.set_version(int(version))
    return {"weight_version": str(int(version))}


def reset_prefix_cache(app: RolloutServer, body: dict, query: dict) -> dict:
    return {}


VLLM_ROUTES = {
    ("GET", "/v1/models"): models,
    ("POST", "/v1/completions"): completions,
    ("GET", "/is_paused"): is_paused,
    ("POST", "/pause"): pause,
    ("POST", "/resume"): resume,
    ("POST", "/collective_rpc"): collective_rpc,
    ("POST", "/update_weight_version"): update_weight_version,
    ("POST", "/reset_prefix_cache"): reset_prefix_cache,
}

__all__ = ["OWNER", "VLLM_ROUTES"]
