"""Tool calls read from the text of an assistant turn.

The default format is Hermes / Qwen's, which their chat templates teach and SmolLM2 follows
when shown one example::

    Let me add them.
    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

A parser never raises on what the model wrote: a call it cannot read is an entry in
``ParsedTurn.errors`` (the environment replies with it, so the model can learn the format).
Whether the named tool exists is the environment's business. Another format is another
:class:`ToolCallParser` subclass, chosen by ``class_path`` in the environment's config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: a tool name and its arguments (a JSON object)."""

    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    """An assistant turn split into its prose, its readable calls, and why the others are unreadable."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ToolCallParser:
    """Reads the tool calls of one assistant turn (:meth:`parse`) and writes calls back as the
    model writes them (:meth:`format`: the agent endpoint renders an assistant message's
    ``tool_calls`` with it when the chat template cannot)."""

    def parse(self, text: str) -> ParsedTurn:
        raise NotImplementedError

    def format(self, calls: list[ToolCall]) -> str:
        """The text of ``calls`` in this parser's format (``parse(format(calls)).calls == calls``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot write tool calls back as text: implement "
                                  "format(calls) -> str, or use a chat template that renders tool_calls")


class HermesToolCallParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number per turn.

    A block without ``"arguments"`` is a call with no arguments. Malformed JSON, a missing or
    non-string ``"name"``, arguments that are not an object, and an unclosed block are errors.

    Args:
        start: the text that opens a call.
        end: the text that closes it.
    """

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>"):
        self.start = start
        self.end = end

    def parse(self, text: str) -> ParsedTurn:
        prose, calls, errors = [], [], []
        position = 0
        while (opening := text.find(self.start, position)) >= 0:
            prose.append(text[position:opening])
            body_start = opening + len(self.start)
            closing = text.find(self.end, body_start)
            if closing < 0:
                errors.append(f"a {self.start} block is not closed by {self.end}")
                position = len(text)
                break
            call, error = self._read_call(text[body_start:closing])
            calls.extend([call] if call else [])
            errors.extend([error] if error else [])
            position = closing + len(self.end)
        prose.append(text[position:])
        return ParsedTurn(content="".join(prose).strip(), calls=calls, errors=errors)

    def format(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"{self.start}\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n{self.end}"
                         for c in calls)

    @staticmethod
    def _read_call(body: str) -> tuple[ToolCall | None, str | None]:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            return None, f"the tool call is not valid JSON ({err.msg} at character {err.pos}): {body.strip()[:80]}"
        if not isinstance(call, dict):
            return None, f'the tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {body.strip()[:80]}'
        name = call.get("name")
        if not isinstance(name, str) or not name:
            return None, f'the tool call has no "name": {body.strip()[:80]}'
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            return None, f'the "arguments" of the call to {name} must be a JSON object, got {json.dumps(arguments)[:60]}'
        return ToolCall(name=name, arguments=arguments), None


__all__ = ["HermesToolCallParser", "ParsedTurn", "ToolCall", "ToolCallParser"]
