"""An engine that samples from its own lower-precision copy of the policy.

:class:`HFCopyEngine` is :class:`~gspo_lightning.rollout.hf.HFEngine`'s sampling loop run on
a *copy* of the policy held in another dtype (``bfloat16`` or ``float16``), optionally with
its linear layers' weights rounded to FP8 (``weight_quantization="fp8"``). New weights
reach the copy as an inference engine's would, through :meth:`update_weights` once per
policy version. Its sampled-token log-probs therefore differ from the float32 trainer's
by the precision gap of a real low-precision inference engine (vLLM in bf16, an FP8
rollout engine), on any device, without installing one:

.. code-block:: yaml

    model:
      old_logprobs: engine        # use the engine's log-probs as pi_old (no recompute pass)
      engine:
        class_path: gspo_lightning.rollout.HFCopyEngine
        init_args: {dtype: bfloat16}

The trainer logs the gap as ``engine/logprob_abs_diff`` and ``engine/seq_log_ratio_abs_max``.
It costs a second copy of the weights, and is meant for one process: a sharded policy
(FSDP2, FSDP, ZeRO-3) has no single copy to cast.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import Tensor, nn

from gspo_lightning.errors import ConfigError
from gspo_lightning.models.vision import is_vision_language
from gspo_lightning.rollout.engine import EngineSpec, WeightsIterator
from gspo_lightning.rollout.hf import HFEngine
from gspo_lightning.rollout.weight_sync import iter_policy_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# the CPU flags of bfloat16 arithmetic units: x86 (/proc/cpuinfo "flags") and ARM ("Features")
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> Optional[list[str]]:
    """The CPU's bfloat16 units (their flags), ``[]`` for none, ``None`` where the CPU cannot be
    read (no /proc/cpuinfo: macOS, Windows)."""
    try:
        flags = set(open(cpuinfo).read().split())
    except OSError:
        return None
    return sorted(flags & set(BF16_FLAGS))


def fp8_round(weight: Tensor) -> Tensor:
    """``weight`` rounded through float8 e4m3 with one absmax scale per output row, back in
    its own dtype (what FP8 weight-only serving does to a linear layer)."""
    w = weight.float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return ((w / scale).to(torch.float8_e4m3fn).float() * scale).to(weight.dtype)


class HFCopyEngine(HFEngine):
    """Samples from a copy of the policy in ``dtype`` (the trainer keeps its own dtype).

    Args:
        dtype: the copy's dtype: ``bfloat16``, ``float16`` (or ``float32``, an exact control).
        weight_quantization: ``"fp8"``: also round the weights of the copy's linear layers
            (not the embeddings or the output head) through float8 e4m3, one scale per output
            row. ``null``: off.
        generation_batch_size: as for :class:`HFEngine`.
    """

    shares_policy_weights = False  # its own copy: new weights are pushed once per version

    def __init__(self, dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
                 weight_quantization: Optional[Literal["fp8"]] = None,
                 generation_batch_size: Optional[int] = None):
        super().__init__(generation_batch_size=generation_batch_size)
        if dtype not in DTYPES:
            raise ConfigError(f"HFCopyEngine dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if weight_quantization not in (None, "fp8"):
            raise ConfigError(f"HFCopyEngine weight_quantization must be 'fp8' or null, got {weight_quantization!r}")
        self.dtype = dtype
        self.weight_quantization = weight_quantization
        self.pushes = 0  # update_weights calls (one per policy version that sampled)
        self._targets: dict[str, Tensor] = {}
        self._quantized: set[str] = set()

    def start(self, spec: EngineSpec) -> None:
        super().start(spec)  # eos / pad ids, lockstep; self.model is the policy for now
        policy = spec.policy
        if spec.lockstep is not None or any(hasattr(p, "full_tensor") or hasattr(p, "ds_id") for p in policy.parameters()):
            raise ConfigError("HFCopyEngine keeps a whole copy of the policy: it does not run with a sharded policy "
                             "(FSDP / FSDP2 / ZeRO-3); use it with one process or DDP")
        # a fresh model from the config, not a deepcopy: the policy may carry hooks (MoE routing
        # records) and optimizer-side state that the copy must not inherit
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        config = policy.config
        device = next(policy.parameters()).device
        if device.type == "cpu" and self.dtype == "bfloat16" and cpu_bf16_units() == []:
            raise ConfigError("HFCopyEngine dtype: bfloat16 on a CPU without bfloat16 units (no avx512_bf16, amx_bf16 "
                              "or bf16 in /proc/cpuinfo): PyTorch emulates bf16 there, slower than float32; sample "
                              "from the float32 policy (model.engine: gspo_lightning.rollout.HFEngine)")
        auto = AutoModelForImageTextToText if is_vision_language(policy) else AutoModelForCausalLM
        copy = auto.from_config(config, dtype=DTYPES[self.dtype], trust_remote_code=spec.trust_remote_code)
        copy.to(device).eval().requires_grad_(False)
        self.model = copy
        self._targets = dict(copy.named_parameters())
        if self.weight_quantization == "fp8":
            head = copy.get_output_embeddings()
            skip = {id(head.weight)} if head is not None else set()
            self._quantized = {f"{module_name}.weight" for module_name, module in copy.named_modules()
                               if isinstance(module, nn.Linear) and id(module.weight) not in skip}
        self._load(iter_policy_weights(policy))  # usable at once; the first rollout pushes its version anyway

    @torch.no_grad()
    def _load(self, weights: WeightsIterator) -> tuple[int, int]:
        count = size = 0
        for name, tensor in weights:
            target = self._targets.get(name)
            if target is None:
                raise KeyError(f"HFCopyEngine: the policy sent {name!r}, which its copy does not have")
            if target.shape != tensor.shape:
                raise ConfigError(f"HFCopyEngine: {name!r} has shape {tuple(tensor.shape)}, the copy {tuple(target.shape)}")
            target.copy_(tensor.detach())  # casts to the copy's dtype
            if name in self._quantized:
                target.copy_(fp8_round(target))
            count += 1
            size += tensor.numel() * tensor.element_size()
        return count, size

    def update_weights(self, weights: WeightsIterator, version: int) -> dict[str, float]:
        count, size = self._load(weights)
        self.weights_version = version
        self.pushes += 1
        return {"tensors": float(count), "bytes": float(size)}

    def close(self) -> None:
        self.model = None
        self._targets = {}


__all__ = ["HFCopyEngine", "cpu_bf16_units", "fp8_round"]
