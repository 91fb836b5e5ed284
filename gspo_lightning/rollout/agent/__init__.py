"""Agent episodes: a user's agent calls an OpenAI-compatible endpoint over the run's engine,
which renders, samples and records every token (docs/agents.md)."""

from gspo_lightning._imports import lazy_exports

EXPORTS = {
    **dict.fromkeys(["AgentEndpoint", "TurnLimits"], "endpoint"),
    **dict.fromkeys(["AgentRunner", "Outcome"], "runner"),
    **dict.fromkeys(["AgentSession", "Segment"], "record"),
}
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
