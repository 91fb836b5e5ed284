"""Errors a run can stop with, shared by the update loop, the module and the callbacks."""


class NonFiniteError(RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient."""


class RolloutServerError(RuntimeError):
    """A rollout server stayed unreachable, or served weights other than the trainer's."""


class EpisodeError(RuntimeError):
    """An environment raised in an episode (``model.episodes.on_environment_error: raise``)."""


class AgentError(RuntimeError):
    """More than half of a step's agent episodes failed (raised, timed out, or never called the endpoint)."""


__all__ = ["AgentError", "EpisodeError", "NonFiniteError", "RolloutServerError"]
