"""Lightning's ``self.log`` without its per-call walk over every result object (Lightning issue #20388).

On every ``self.log`` call Lightning moves the key's result object to the value's device
(``_ResultMetric.to``), and that walks the object's whole ``__dict__`` with
``apply_to_collection``, deep-copying its metadata: ~0.3 ms a key, 13 ms a step for the ~40
metrics a GSPO step logs, a sixth of the quickstart's step. When every tensor the object holds
is already on that device the walk changes nothing, so :func:`install` skips it then and hands
every other call (another device, a dtype, keyword arguments) to Lightning's own method. The same
check as the open upstream fix (Lightning PR #21769); nothing else of Lightning is touched.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MARK = "_gspo_skips_walk_on_same_device"


def install() -> bool:
    """Wrap ``_ResultMetric.to`` once per process; ``False`` (nothing done) when this Lightning has
    no such method or something else already replaced it."""
    try:
        from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
    except ImportError:  # a Lightning that moved it: its own code runs unchanged
        return False
    lightning_to = _ResultMetric.__dict__.get("to")
    if lightning_to is None:
        return False
    if getattr(lightning_to, _MARK, False):
        return True
    if getattr(lightning_to, "__qualname__", "") != "_ResultMetric.to":
        return False

    def to(self, *args, **kwargs):
        if not kwargs and len(args) == 1 and isinstance(args[0], (str, torch.device)):
            if _tensors_all_on(self.__dict__, torch.device(args[0])):
                return self  # the walk would only copy what it found
        return lightning_to(self, *args, **kwargs)

    setattr(to, _MARK, True)
    to.__doc__ = lightning_to.__doc__
    _ResultMetric.to = to
    return True


def _tensors_all_on(state: dict, device: torch.device) -> bool:
    """Whether each tensor among ``state``'s values (and in dicts, lists and tuples under them) is on
    ``device``. Any other object that could hold tensors (a torchmetrics ``Metric``, a module) makes it
    ``False``: the full walk handles those. Plain values (numbers, strings, callables, the metadata
    dataclasses, which hold no tensors) are skipped."""
    stack = list(state.values())
    while stack:
        value = stack.pop()
        if isinstance(value, Tensor):
            if value.device != device:
                return False
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, torch.nn.Module):
            return False
    return True


__all__ = ["install"]
