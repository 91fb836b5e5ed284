"""Grouped-query attention in one SDPA call when the run is on CPU.

A model with fewer key/value heads than query heads (Qwen2, Llama 3, SmolLM2...) shares each key/value
head among a group of query heads. transformers' SDPA attention copies every key/value head once per
query head of its group before the call, unless no mask is given: CUDA's fast kernels need that. Our
forwards always pass a padding mask, so on CPU the copies, and in backward the sums over each group,
ran on every layer of every forward. torch's CPU kernel takes the groups itself with a mask
(``enable_gqa=True``) and gives the same outputs: on 2 cores a 0.6M-parameter model's training step
(64 responses of 32 tokens) went from 0.229 to 0.210 s (benchmarks/bench_grid.py; docs/benchmarks.md).

transformers' switch for it is the environment variable ``TRANSFORMERS_SDPA_FORCE_GQA``, read on each
call: :func:`group_attention_on_cpu` sets it for a run on CPU unless the user set it.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

import torch

SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


def group_attention_on_cpu(device: torch.device, environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Set :data:`SWITCH` to ``"1"`` when ``device`` is the CPU and the variable is unset; returns
    whether grouped-query attention is on. A GPU run leaves it alone (there its mask would take a
    slower kernel), and so does a value the user chose."""
    environ = os.environ if environ is None else environ
    if SWITCH not in environ and device.type == "cpu":
        environ[SWITCH] = "1"
    return environ.get(SWITCH) == "1"


__all__ = ["SWITCH", "group_attention_on_cpu"]
