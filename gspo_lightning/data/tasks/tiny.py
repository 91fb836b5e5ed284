"""The tiny models' former path: they are built in ``gspo_lightning/models/tiny.py`` (models/
imports nothing from data/), and these names stay importable from here for the tasks, tests
and scripts that name them."""

from gspo_lightning.models.tiny import (  # noqa: F401
    BUILTIN_PREFIX, CHAT_TEMPLATE, CORPUS_FILES, ECHO_WORDS, LOOKUP_CHAT_TEMPLATE, LOOKUP_WORDS, SPECIAL_TOKENS,
    SUCCESSOR_WORDS, TINY_MODELS, TinyModelSpec, build_config, build_tiny, build_tiny_model, build_tokenizer, get_spec,
    is_builtin, save_tiny,
)

__all__ = ["BUILTIN_PREFIX", "TINY_MODELS", "TinyModelSpec", "build_tiny", "build_tokenizer", "get_spec", "is_builtin",
           "save_tiny"]
