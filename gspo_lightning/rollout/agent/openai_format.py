"""OpenAI chat-completions requests read with bounds, and replies written as the ``openai``
client and agent frameworks parse them (one object, or server-sent events when streaming).

Only what changes sampling or the reply is read; other fields (``store``, ``metadata``,
``parallel_tool_calls``, ``response_format``, ...) are accepted and ignored. Errors are
:class:`RequestError` with the HTTP status and OpenAI's error shape.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from gspo_lightning.episodes.parsers import ToolCallParser

MAX_MESSAGES = 4096
MAX_STOP_STRINGS = 4


class RequestError(ValueError):
    """A request refused: ``status`` and a message that says what to change."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.kind = kind

    def payload(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "code": self.status}}


@dataclass
class ChatRequest:
    """What the endpoint reads from ``POST /v1/chat/completions``."""

    model: str
    messages: list[dict]
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict] = "auto"
    max_tokens: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None

    @property
    def tools_key(self) -> str:
        """The tools as shown: a conversation continues only under the same tools."""
        return json.dumps(self.tools, sort_keys=True) if self.tools else ""

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _number(body: dict, key: str, low: float, high: float) -> Optional[float]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
        raise RequestError(f"{key} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def parse_chat_request(body: Any) -> ChatRequest:
    """A chat-completions body checked field by field (a :class:`RequestError` names the first problem)."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of chat messages")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"at most {MAX_MESSAGES} messages per request, got {len(messages)}")
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"messages[{position}] must be an object with a role of system, developer, user, "
                               "assistant or tool")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"messages[{position}].content must be text, a list of parts or null")
        if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") not in ("text", "input_text")
                                             for p in content):
            raise RequestError(f"messages[{position}].content: only text parts are served (this endpoint's model reads "
                               "text)")
        if message["role"] == "developer":  # OpenAI's newer name for system
            messages[position] = {**message, "role": "system"}
        if isinstance(content, list):
            messages[position] = {**messages[position], "content": "".join(p.get("text", "") for p in content)}
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(f"n must be 1 (one sample per call: an episode is one trajectory), got {n!r}")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or any(not isinstance(t, dict) or t.get("type", "function") != "function"
                                              or not isinstance(t.get("function"), dict)
                                              or not isinstance(t["function"].get("name"), str) for t in tools):
            raise RequestError('tools must be a list of {"type": "function", "function": {"name": ..., "parameters": '
                               '...}}')
        tools = [{"type": "function", "function": t["function"]} for t in tools] or None
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice is None:
        tool_choice = "auto"
    if not (tool_choice in ("auto", "none", "required") or (isinstance(tool_choice, dict)
                                                            and isinstance(tool_choice.get("function"), dict))):
        raise RequestError(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "function": '
                           f'{{"name": ...}}}}, got {tool_choice!r}')
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stop):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    stream_options = body.get("stream_options") or {}
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None and (not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20):
        raise RequestError(f"top_logprobs must be an integer in [0, 20], got {top_logprobs!r}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"seed must be an integer, got {seed!r}")
    return ChatRequest(
        model=str(body.get("model", "")), messages=messages, tools=tools, tool_choice=tool_choice, max_tokens=max_tokens,
        stop=stop, stream=bool(body.get("stream", False)), include_usage=bool(stream_options.get("include_usage")),
        logprobs=bool(body.get("logprobs", False)), return_token_ids=bool(body.get("return_token_ids", False)),
        temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0), seed=seed,
    )


@dataclass
class Reply:
    """One sampled turn, ready to write: the agent-facing message and what the reply reports."""

    message: dict  # {"role": "assistant", "content": ..., "tool_calls": [...]}
    finish_reason: str  # stop | length | tool_calls
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    tokens: list[str]  # each sampled token's text, for logprobs


def assistant_reply(text: str, parser: Optional[ToolCallParser]) -> dict:
    """The reply message of a turn whose text is ``text``: with ``parser``, the calls read after
    the last ``</think>`` become ``tool_calls`` (each with a fresh id) and leave the content;
    a turn with an unreadable call keeps its whole text, so the agent sees what was written."""
    if parser is None:
        return {"role": "assistant", "content": text}
    head, think, tail = text.rpartition("</think>")
    turn = parser.parse(tail)
    if not turn.calls:
        return {"role": "assistant", "content": text}
    content = text if turn.errors else f"{head}{think}{turn.content}".strip()
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": call.name, "arguments": json.dumps(call.arguments)}} for call in turn.calls]
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


def _logprobs_block(reply: Reply) -> dict:
    return {"content": [{"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
                        for token, logprob in zip(reply.tokens, reply.logprobs)]}


def completion_object(reply: Reply, request: ChatRequest, model: str) -> dict:
    """The ``chat.completion`` object of a reply."""
    choice = {"index": 0, "message": reply.message, "finish_reason": reply.finish_reason,
              "logprobs": _logprobs_block(reply) if request.logprobs else None}
    if request.return_token_ids:
        choice["token_ids"] = reply.ids
    body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": _usage(reply)}
    if request.return_token_ids:
        body["prompt_token_ids"] = reply.prompt_ids
    return body


def _usage(reply: Reply) -> dict:
    return {"prompt_tokens": len(reply.prompt_ids), "completion_tokens": len(reply.ids),
            "total_tokens": len(reply.prompt_ids) + len(reply.ids)}


def stream_events(reply: Reply, request: ChatRequest, model: str) -> list[bytes]:
    """The reply as server-sent events: the role, the content, each tool call, the finish
    reason, the usage when asked (``stream_options.include_usage``), then ``[DONE]``. Token ids
    and log-probs ride on the content chunk (the whole turn is sampled before the first byte)."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta: dict, finish_reason: Optional[str] = None, **extra) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, **extra}
        body = {**base, "choices": [choice]}
        if request.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n".encode()

    first_extra = {"prompt_token_ids": reply.prompt_ids} if request.return_token_ids else {}
    events = [f"data: {json.dumps({**base, 'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}, 'finish_reason': None}], **first_extra})}\n\n".encode()]
    extra = {}
    if request.return_token_ids:
        extra["token_ids"] = reply.ids
    if request.logprobs:
        extra["logprobs"] = _logprobs_block(reply)
    content = reply.message.get("content")
    if content or extra:
        events.append(chunk({"content": content or ""}, **extra))
    for index, call in enumerate(reply.message.get("tool_calls") or []):
        events.append(chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                             "function": {"name": call["function"]["name"],
                                                          "arguments": call["function"]["arguments"]}}]}))
    events.append(chunk({}, reply.finish_reason))
    if request.include_usage:
        events.append(f"data: {json.dumps({**base, 'choices': [], 'usage': _usage(reply)})}\n\n".encode())
    events.append(b"data: [DONE]\n\n")
    return events


__all__ = ["ChatRequest", "Reply", "RequestError", "assistant_reply", "completion_object", "parse_chat_request",
           "stream_events"]
