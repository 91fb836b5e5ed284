"""The lookup task: an answer only a tool knows, for multi-turn episodes on a tiny model.

Prompt ``find c``. Each row has its own table of six keys ``a``..``f`` with random digits, which
the prompt does not show: the only way to the answer is to call the tool, ``get c``, read the
reply (the environment's ``tool`` message holds the digit), and answer with that digit. An
episode: ``user: find c`` / ``assistant: get c<eos>`` / ``tool: 7`` / ``assistant: 7<eos>``.

A random policy guesses right about one time in 25 (a digit first, the right one), so the reward
starts near 0. The call format is one word and a key (:class:`WordCallParser`, chosen for a
20-word vocabulary, in place of the JSON of :class:`~gspo_lightning.episodes.HermesToolCallParser`).
``lookup_call_reward`` (a small weight in the recipe) rewards a well-formed call with the right
key, the first thing to learn; ``lookup_answer_reward`` is the task's accuracy.
"""

from __future__ import annotations

import random
from typing import Optional

# the one import up the folders' order (tests/test_folder_order.py): a task with an environment
# builds on episodes/, which imports nothing from data/
from gspo_lightning.episodes import Environment, ParsedTurn, StepResult, ToolCall, ToolCallParser

KEYS = ("a", "b", "c", "d", "e", "f")  # in the tiny-lookup model's vocabulary: models/tiny.py's LOOKUP_WORDS


def make_rows(num_rows: int, seed: int) -> list[dict]:
    """Rows with a ``prompt``, the asked ``key``, the row's ``table`` (six digits, one per key,
    as a string) and the ``answer``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        table = [str(rng.randrange(10)) for _ in KEYS]
        key = rng.choice(KEYS)
        rows.append({"prompt": f"find {key}", "key": key, "table": " ".join(table), "answer": table[KEYS.index(key)]})
    return rows


class WordCallParser(ToolCallParser):
    """``get c``: a tool call when the turn's first word names a tool; its next word is the argument."""

    def __init__(self, tools: tuple[str, ...] = ("get",), argument: str = "key"):
        self.tools = tools
        self.argument = argument

    def parse(self, text: str) -> ParsedTurn:
        words = text.split()
        if not words or words[0] not in self.tools:
            return ParsedTurn(content=text, calls=[], errors=[])
        if len(words) < 2:
            return ParsedTurn(content="", calls=[], errors=[f"{words[0]} needs a {self.argument}"])
        return ParsedTurn(content="", calls=[ToolCall(name=words[0], arguments={self.argument: words[1]})], errors=[])

    def format(self, calls: list[ToolCall]) -> str:
        return " ".join(f"{call.name} {call.arguments.get(self.argument, '')}".strip() for call in calls)


class LookupEnvironment(Environment):
    """Answers ``get <key>`` with the row's digit for that key; an unknown key gets ``tool: error``
    (counted). A turn that is not a call ends the episode: it is the answer."""

    blocking = False  # a table lookup: stepped on the runner's loop, no thread per call

    def __init__(self, parser: Optional[ToolCallParser] = None):
        self.parser = parser if parser is not None else WordCallParser()
        self.table: dict[str, str] = {}

    def reset(self, row: dict, prompt: list[dict]) -> list[dict]:
        self.table = dict(zip(KEYS, str(row["table"]).split()))
        return prompt

    def step(self, assistant_message: dict) -> StepResult:
        turn = self.parser.parse(assistant_message.get("content") or "")
        if not turn.calls and not turn.errors:
            return StepResult(messages=[], done=True)
        if turn.errors:
            return StepResult(messages=[{"role": "tool", "content": "error"}], info={"tool_calls": 1, "tool_errors": 1})
        value = self.table.get(str(turn.calls[0].arguments.get("key")))
        reply = {"role": "tool", "name": "get", "content": value if value is not None else "error"}
        return StepResult(messages=[reply], info={"tool_calls": 1, "tool_errors": int(value is None)})


class LookupTable:
    """The lookup task as an environment class written for TRL's ``environment_factory``: the
    row's table is set by ``reset(**row)`` and read by the typed tool method ``get``. Nothing in it
    knows this trainer (configs/episodes_lookup_trl.yaml runs it as TRL's GRPOTrainer would)."""

    def reset(self, table: str, **row) -> None:
        self._table = dict(zip(KEYS, table.split()))
        self.calls = 0

    def get(self, key: str) -> str:
        """Read the digit stored under a key of this episode's table.

        Args:
            key: One of the letters a to f.
        """
        self.calls += 1
        return self._table.get(key, "error")


def _assistant_texts(completion) -> list[str]:
    return [m.get("content") or "" for m in completion if m.get("role") == "assistant"]


def lookup_answer_reward(completions: list, answer: list[str], **columns) -> list[float]:
    """1 when, after a tool reply, the last assistant turn answers with the row's digit (its first
    word); else 0 (no credit for the answer's form: a fixed digit would then be a resting point)."""
    scores = []
    for completion, digit in zip(completions, answer):
        texts = _assistant_texts(completion)
        words = texts[-1].split() if texts else []
        called = any(m.get("role") == "tool" for m in completion)
        first = words[0] if words else ""
        scores.append(float(called and first == digit))
    return scores


def lookup_call_reward(completions: list, key: list[str], **columns) -> list[float]:
    """1 when the episode's first turn calls for the asked key and the tool answered it (the turn
    ended, so the episode went on), 0.5 when it starts with that call but never ended, else 0."""
    scores = []
    for completion, asked in zip(completions, key):
        texts = _assistant_texts(completion)
        words = texts[0].split() if texts else []
        answered = len(completion) > 1 and completion[1].get("role") == "tool"
        scores.append(float(words[:2] == ["get", asked]) * (1.0 if answered else 0.5))
    return scores


__all__ = ["KEYS", "LookupEnvironment", "LookupTable", "WordCallParser", "lookup_answer_reward", "lookup_call_reward", "make_rows"]
