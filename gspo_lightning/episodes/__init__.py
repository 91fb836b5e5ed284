"""Multi-turn episodes, engine-independent parts: tools from typed functions, tool-call
parsers, environments chosen by ``class_path``, the chat renderer that turns environment
messages into tokens appended after the model's own (token-in, token-out), and the episodes'
settings (``MultiTurn``). The runner that drives an engine through the turns is
``gspo_lightning/rollout/episodes.py``: nothing here imports rollout/."""

from gspo_lightning._imports import lazy_exports

EXPORTS = {
    "StepResult": "messages",
    **dict.fromkeys(["Tool", "ToolError", "load_tools"], "tools"),
    **dict.fromkeys(["HermesToolCallParser", "ParsedTurn", "ToolCall", "ToolCallParser"], "parsers"),
    **dict.fromkeys(["Environment", "ToolEnvironment"], "environments"),
    "FactoryEnvironment": "factory",
    "SkyRLEnvironment": "skyrl",
    "OpenEnvEnvironment": "openenv",
    "ShowImageEnvironment": "show_image",
    "EpisodeLoop": "loop",
    **dict.fromkeys(["ChatRenderer", "DEFAULT_TOOLS_SYSTEM_PROMPT", "TemplateNotAppendOnly"], "template"),
    **dict.fromkeys(["MultiTurn", "check_episode_objective"], "multi_turn"),
}
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
