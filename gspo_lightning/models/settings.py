"""The ``policy`` config block: how the policy (and its frozen reference) is loaded (``models/loading.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gspo_lightning.objective.options import Dtype, check_choice


@dataclass
class Policy:
    """How the policy is loaded.

    Args:
        dtype: weight dtype: ``float32``, ``bfloat16`` or ``float16``.
        attn_implementation: passed to ``from_pretrained`` (``sdpa``, ``flash_attention_2``...).
        gradient_checkpointing: recompute decoder activations in backward to save memory.
        trust_remote_code: allow a hub model's own Python code (off unless you trust it).
        gguf_file: the GGUF file inside the folder ``model_name_or_path`` (transformers' ``gguf_file``).
        freeze_vision: a vision-language policy's vision tower gets no gradient and is shared with
            the reference model (``false``: train it too).
    """

    dtype: Dtype = "float32"
    attn_implementation: Optional[str] = None
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    gguf_file: Optional[str] = None
    freeze_vision: bool = True

    def problems(self) -> list[str]:
        try:
            check_choice("dtype", self.dtype, Dtype)
        except ValueError as err:
            return [str(err)]
        return []


__all__ = ["Policy"]
