"""What the agent endpoint records per episode, and how a call's history is matched to it.

An episode is a session (its own API key). Each call sends the whole conversation again, in
the agent's own form (OpenAI messages, assistant turns with ``tool_calls``). The record keeps
two views of the same positions:

- ``shown``: each message as the agent holds it (our replies as we returned them), to match the
  history the next call sends;
- ``messages``: each message as the chat template renders it, assistant turns as the model
  wrote them (the decoded sampled ids, tool calls still in the text).

A call whose history is the recorded one plus new messages after our last reply *extends* the
record: only the new messages are rendered (``ChatRenderer.continuation_ids``) and appended as
the environment's tokens, masked; the model's turns keep the ids the engine sampled. Any other
history (edited, truncated, reordered, other tools, or a template that rewrites earlier turns)
starts a new *segment*, rendered whole from the agent's messages, and is counted as a fork.
An episode trains on its last segment (docs/agents.md says why); the others are counted.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional

from gspo_lightning.episodes.parsers import ToolCall, ToolCallParser
from gspo_lightning.episodes.template import ChatRenderer, TemplateNotAppendOnly
from gspo_lightning.errors import ConfigError


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    raise ConfigError(f"a message's content must be text or a list of parts, got {type(content).__name__}")


def tool_calls_of(message: dict) -> list[ToolCall]:
    """An OpenAI assistant message's ``tool_calls`` as :class:`ToolCall` (arguments parsed)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as err:
                raise ConfigError(f"a tool call's arguments are not JSON: {arguments[:80]!r}") from err
        calls.append(ToolCall(name=str(function.get("name", "")), arguments=arguments if isinstance(arguments, dict) else {}))
    return calls


def same_message(sent: dict, recorded: dict) -> bool:
    """Whether a message the agent sent back is the recorded one: role, text and tool calls (by
    name and parsed arguments: clients re-serialize JSON and may drop or rename ids)."""
    if sent.get("role") != recorded.get("role"):
        return False
    try:
        if content_text(sent.get("content")).strip() != content_text(recorded.get("content")).strip():
            return False
        return tool_calls_of(sent) == tool_calls_of(recorded)
    except ValueError:
        return False


def template_messages(messages: list[dict], parser: ToolCallParser, renders_tool_calls: bool) -> list[dict]:
    """The agent's messages as the chat template takes them: text contents; an assistant
    message's ``tool_calls`` kept for a template that renders them (arguments as objects), else
    written into its text in the parser's format, as the model would have written them."""
    converted = []
    for message in messages:
        out = {"role": message.get("role"), "content": content_text(message.get("content"))}
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                out[key] = message[key]
        calls = tool_calls_of(message) if message.get("role") == "assistant" else []
        if calls and renders_tool_calls:
            out["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
        elif calls:
            written = parser.format(calls)
            out["content"] = f"{out['content']}\n{written}" if out["content"] else written
        converted.append(out)
    return converted


@dataclass
class Segment:
    """One token sequence of an episode: a prompt rendered once, then the model's turns (ids as
    sampled) and the environment's messages between them (rendered once, masked)."""

    renderer: ChatRenderer
    tools_key: str
    prompt_ids: list[int]
    num_prompt_messages: int
    messages: list[dict]  # as the template renders them
    shown: list[dict]  # the same positions as the agent holds them
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_of_token: list[int] = field(default_factory=list)  # the model turn of each token; -1: environment
    versions: list[Optional[int]] = field(default_factory=list)  # the weights version of each model turn
    turns: int = 0
    last_turn_closed: bool = True  # whether the last model turn ended with the end-of-turn token
    rendered: str = ""  # the template's text the ids stand for, up to the last generation prompt

    def add_environment(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.turn_of_token += [-1] * len(ids)

    def add_model_turn(self, ids: list[int], logprobs: list[float], version: Optional[int], closed: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.turn_of_token += [self.turns] * len(ids)
        self.versions.append(version)
        self.turns += 1
        self.last_turn_closed = closed

    @property
    def environment_tokens(self) -> int:
        return sum(t < 0 for t in self.turn_of_token)


@dataclass
class PreparedCall:
    """A call's prompt ids and what recording its reply will change."""

    segment: Segment
    prompt_ids: list[int]
    new_segment: bool  # the call starts a segment (the first call, or a fork)
    environment_ids: list[int] = field(default_factory=list)  # to append before the model's turn
    new_messages: list[dict] = field(default_factory=list)  # template form
    new_shown: list[dict] = field(default_factory=list)  # agent form
    rendered: str = ""  # the conversation's text once the new messages are in (extending calls)


class AgentSession:
    """One episode's key and record."""

    def __init__(self, index: int, row: dict):
        self.index = index
        self.row = row
        self.key = "gspo-" + secrets.token_urlsafe(24)
        self.segments: list[Segment] = []
        self.calls = 0
        self.forks = 0
        self.tool_calls = 0  # calls the replies carried
        self.open = True  # False once the episode ended: its key gets 401 from then on
        self.budget_spent = False

    @property
    def segment(self) -> Optional[Segment]:
        return self.segments[-1] if self.segments else None

    def prepare(self, messages: list[dict], tools_key: str, renderer: ChatRenderer, parser: ToolCallParser,
                renders_tool_calls: bool) -> PreparedCall:
        """The prompt of a call whose history is ``messages``: the record extended, or a new segment."""
        segment = self.segment
        if (segment is not None and segment.tools_key == tools_key and segment.shown
                and segment.shown[-1].get("role") == "assistant" and len(messages) > len(segment.shown)
                and all(same_message(s, r) for s, r in zip(messages, segment.shown))):
            new_shown = messages[len(segment.shown):]
            new_messages = template_messages(new_shown, parser, renders_tool_calls)
            try:
                environment_ids, rendered = segment.renderer.continuation(segment.messages, new_messages, segment.rendered)
            except TemplateNotAppendOnly:
                environment_ids = None  # the template rewrites earlier turns: a new segment
            if environment_ids is not None:
                if not segment.last_turn_closed and segment.renderer.end_of_turn:
                    # the turn was cut before its end-of-turn token: the template writes it, the model did not
                    environment_ids = [segment.renderer.end_of_turn_id, *environment_ids]
                return PreparedCall(segment, segment.prompt_ids + segment.ids + environment_ids, False,
                                    environment_ids, new_messages, list(new_shown), rendered)
        converted = template_messages(messages, parser, renders_tool_calls)
        text = renderer.render(converted, add_generation_prompt=True)
        prompt_ids = renderer.prompt_ids(converted)
        fresh = Segment(renderer=renderer, tools_key=tools_key, prompt_ids=prompt_ids, num_prompt_messages=len(messages),
                        messages=converted, shown=[dict(m) for m in messages], rendered=text)
        return PreparedCall(fresh, prompt_ids, True)

    def record(self, call: PreparedCall, ids: list[int], logprobs: list[float], version: Optional[int], closed: bool,
               text: str, reply: dict) -> None:
        """Keep a call's sampled turn: ``text`` as the template renders it, ``reply`` as returned."""
        segment = call.segment
        if call.new_segment:
            self.forks += bool(self.segments)
            self.segments.append(segment)
        else:
            segment.add_environment(call.environment_ids)
            segment.messages += call.new_messages
            segment.shown += call.new_shown
            segment.rendered = call.rendered
        segment.add_model_turn(ids, logprobs, version, closed)
        segment.messages.append({"role": "assistant", "content": text})
        segment.shown.append(reply)
        self.tool_calls += len(reply.get("tool_calls") or [])


__all__ = ["AgentSession", "PreparedCall", "Segment", "content_text", "same_message", "template_messages", "tool_calls_of"]
