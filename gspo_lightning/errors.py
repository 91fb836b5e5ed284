"""Errors a run can stop with, shared by the update loop, the module and the callbacks.

The ``gspo`` command shows these in one line, as the user's to fix (``--debug`` for the
traceback); anything else (a bug here or in a library) keeps its traceback."""


class ConfigError(ValueError):
    """A setting, argument or input given to the run is wrong; the message says what to change."""


class MissingPackageError(ImportError):
    """An optional package a setting needs is not installed; the message gives the install command."""


class NonFiniteError(RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient."""


class RolloutServerError(RuntimeError):
    """A rollout server stayed unreachable, or served weights other than the trainer's."""


class EpisodeError(RuntimeError):
    """An environment raised in an episode (``model.episodes.on_environment_error: raise``)."""


class AgentError(RuntimeError):
    """More than half of a step's agent episodes failed (raised, timed out, or never called the endpoint)."""


__all__ = ["AgentError", "ConfigError", "EpisodeError", "MissingPackageError", "NonFiniteError", "RolloutServerError"]
