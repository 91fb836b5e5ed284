"""The loss scaler of fp16 mixed precision, seen from the updater.

With ``precision: 16-mixed`` Lightning's precision plugin multiplies every loss by the
``GradScaler``'s scale before backward, and divides the gradients back (``unscale_``) in
its ``optimizer_step``: after the updater has measured and clipped them. Unscaling
earlier ourselves would make the plugin unscale a second time (an error), and stepping
the scaler ourselves would bypass Lightning's step counter. Instead the updater works on
the scaled gradients in the scaler's units: clipping them at ``max_norm * scale`` is the
same clip as clipping the unscaled ones at ``max_norm`` (the same coefficient), and the
norm it reports is divided by the scale. The plugin then unscales, skips a step whose
gradients overflowed and updates the scale, each exactly once.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import Tensor, nn

from gspo_lightning.training.distributed import GradientSync, clip_grad_norm


class LossScaling:
    """``scaler``: the precision plugin's ``GradScaler`` (``None`` or disabled: no scaling)."""

    def __init__(self, scaler: Optional["torch.amp.GradScaler"] = None):
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None

    @property
    def active(self) -> bool:
        return self.scaler is not None

    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def clip_grad_norm(self, params: Iterable[nn.Parameter], max_norm: Optional[float], sync: GradientSync,
                       device) -> Tensor:
        """The unscaled gradient norm, with the gradients clipped to ``max_norm`` in unscaled units."""
        scale = self.scale()
        norm = clip_grad_norm(params, None if max_norm is None else max_norm * scale, sync, device)
        return norm / scale

    def skip_overflow(self, plugin_step: Callable[[], None]) -> Optional[float]:
        """After an overflow: ``plugin_step`` (the precision plugin's optimizer step) unscales,
        finds the inf, skips the step and lowers the scale. Returns the new scale (``None``
        without a scaler: nothing to do)."""
        if self.scaler is None:
            return None
        plugin_step()
        return self.scale()


__all__ = ["LossScaling"]
