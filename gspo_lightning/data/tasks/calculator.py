"""A calculator tool for two-digit sums: the real-model multi-turn recipe (SmolLM2-135M-Instruct).

The model gets the ``builtin:addition-2digit`` questions (``What is 47 + 38? Answer with only the
number.``), which it answers right 3-8% of the time on its own, and an ``add`` tool. The
episode's conversation starts with one worked exchange (:data:`WORKED_EXAMPLE`: a question, the
assistant's call, the tool's reply, the answer), because SmolLM2's chat template has no tools
section and the model, told about the tool in a system message alone, never calls it; with one
example it makes a well-formed call in about half of its samples. Then RL has signal: an
episode that calls ``add`` and repeats its result is right.

``calculator_reward`` scores the episode's final answer (the last integer of its last assistant
turn), whatever way it got there: the tool is a means, not a goal.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


WORKED_EXAMPLE = [
    {"role": "user", "content": "What is 23 + 45? Answer with only the number."},
    {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 23, "b": 45}}</tool_call>'},
    {"role": "tool", "name": "add", "content": "68"},
    {"role": "assistant", "content": "68"},
]


def calculator_reward(completions: list, answer: list[str], **columns) -> list[float]:
    """1 when the last integer of the episode's last assistant turn is the sum, else 0."""
    scores = []
    for completion, expected in zip(completions, answer):
        texts = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
        numbers = _INTEGER.findall(texts[-1]) if texts else []
        scores.append(float(bool(numbers) and numbers[-1] == expected))
    return scores


def called_the_tool(completions: list, **columns) -> list[float]:
    """1 when the episode has a tool reply without an error (a metric-like reward, weight 0 in recipes)."""
    return [float(any(m.get("role") == "tool" and not str(m.get("content", "")).startswith("Error") for m in c))
            for c in completions]


__all__ = ["WORKED_EXAMPLE", "add", "calculator_reward", "called_the_tool"]
