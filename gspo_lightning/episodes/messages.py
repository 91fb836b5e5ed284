"""What an environment answers to one assistant turn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class StepResult:
    """An environment's answer to one assistant turn.

    Args:
        messages: chat messages to append after the assistant turn (``{"role": "tool", ...}``,
            ``{"role": "user", ...}``); rendered once by the chat template into the episode's
            environment tokens. Empty when the environment has nothing to say.
        reward: this turn's reward, or ``None`` for none (the episode's reward functions still
            score the whole episode).
        done: the episode ends here; no further assistant turn is generated.
        info: counts to log and sum over episodes, e.g. ``{"tool_calls": 2, "tool_errors": 1}``.
    """

    messages: list[dict]
    reward: Optional[float] = None
    done: bool = False
    info: dict[str, int] = field(default_factory=dict)


__all__ = ["StepResult"]
