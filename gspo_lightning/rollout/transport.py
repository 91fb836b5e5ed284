"""How new weights travel from the trainer to where an engine loads them: one idea,
:class:`WeightTransport`, for every hop.

The trainer side :meth:`~WeightTransport.send` s the policy's ``(name, tensor)`` pairs as they
stream out of ``iter_policy_weights`` and returns a *manifest* that says where they are; the
receiving side turns the manifest back into the same ``(name, tensor)`` iterator
(:meth:`~WeightTransport.receive`) for :meth:`RolloutEngine.update_weights`;
:meth:`~WeightTransport.push` does both, with a ``deliver(manifest)`` that has the receiver load.

* :class:`InProcessTransport`: the engine lives in the training process (the Hugging Face
  engines, an in-process vLLM, the client engine of rollout servers): the manifest carries the
  iterator itself, nothing is copied. The rollout worker's default.

A rollout server in another process or on other machines gets them over a transport whose
manifest is small JSON, chosen in the client engine's config
(``model.engine.init_args.transport``):

* :class:`FolderTransport`: safetensors buckets in a folder both sides can read
  (``/dev/shm`` on one machine, a shared filesystem across nodes). Tested here.
* :class:`NCCLTransport`: a NCCL broadcast from trainer rank 0 to the server's GPU
  (vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``). Written against vLLM's
  API, untested: this project's CI has no GPU.

Every push carries a :class:`WeightsChecksum` of the tensors sent, which the server
compares with what it then holds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from gspo_lightning.rollout.engine import WeightsIterator

Manifest = dict[str, Any]


class WeightsChecksum:
    """sha256 over ``(name, dtype, shape, bytes)`` of each tensor, in the order given.

    Both sides compute it: the trainer over what it sends, the server over what it holds
    after loading, so a server holding other weights than it claims is caught."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.tensors = 0
        self.bytes = 0

    def update(self, name: str, tensor: Tensor) -> None:
        data = tensor.detach().to("cpu").contiguous()
        self._hash.update(f"{name}|{str(data.dtype).removeprefix('torch.')}|{tuple(data.shape)}|".encode())
        raw = data.reshape(-1).view(torch.uint8).numpy()
        self._hash.update(raw)
        self.tensors += 1
        self.bytes += raw.nbytes

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def checksum_of(named: WeightsIterator) -> str:
    """The checksum of ``(name, tensor)`` pairs (a model's full weights, in a fixed order)."""
    total = WeightsChecksum()
    for name, tensor in named:
        total.update(name, tensor)
    return total.hexdigest()


class WeightTransport(ABC):
    """Moves weights to where an engine loads them: :meth:`send` on the trainer, :meth:`receive`
    where the engine is (this process, or a rollout server)."""

    kind: str = ""

    @abstractmethod
    def send(self, weights: WeightsIterator, version: int) -> Manifest:
        """Write ``weights``; the manifest says where the server reads them, with ``names``
        (in order), ``checksum``, ``tensors`` and ``bytes``."""

    def push(self, weights: WeightsIterator, version: int, deliver: Callable[[Manifest], Any]) -> tuple[Manifest, Any]:
        """Send ``weights`` and have ``deliver(manifest)`` make the receiving side load them (an
        engine's ``update_weights`` over :meth:`receive`, or a request to the servers)."""
        manifest = self.send(weights, version)
        return manifest, deliver(manifest)

    def sent(self, manifest: Manifest) -> None:
        """Every server loaded ``manifest``: what older pushes left behind can go."""

    @staticmethod
    @abstractmethod
    def receive(manifest: Manifest) -> Iterator[tuple[str, Tensor]]:
        """The receiving side: the pushed ``(name, tensor)`` pairs, in order."""

    def close(self) -> None:
        """End of the run: remove what the transport wrote."""


class InProcessTransport(WeightTransport):
    """The engine lives in this process: the manifest carries the ``(name, tensor)`` iterator
    itself, so the engine reads the policy's weights as they are gathered, with no copy."""

    kind = "in-process"

    def send(self, weights: WeightsIterator, version: int) -> Manifest:
        return {"kind": self.kind, "version": version, "weights": weights}

    @staticmethod
    def receive(manifest: Manifest) -> Iterator[tuple[str, Tensor]]:
        return iter(manifest["weights"])


class FolderTransport(WeightTransport):
    """safetensors buckets of at most ``bucket_mb`` MiB in ``path/v<version>/``.

    Args:
        path: a folder the server can read (``null``: a fresh folder in ``/dev/shm`` when it
            exists, else in the temporary directory; across nodes give a shared filesystem).
        bucket_mb: largest bucket file; buckets are written as the weights stream in, so the
            trainer never holds more than one bucket beyond its own weights.
    """

    kind = "folder"

    def __init__(self, path: Optional[str] = None, bucket_mb: float = 256.0):
        if bucket_mb <= 0:
            raise ValueError(f"FolderTransport bucket_mb must be > 0, got {bucket_mb}")
        self.path = path
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._own_root: Optional[str] = None
        self._current: Optional[Path] = None

    def _root(self) -> Path:
        if self.path is not None:
            Path(self.path).mkdir(parents=True, exist_ok=True)
            return Path(self.path)
        if self._own_root is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
            remove_dead_runs_folders(Path(base))
            # the pid in the name: a later run removes this folder if this process dies without cleaning up (SIGKILL)
            self._own_root = tempfile.mkdtemp(prefix=f"{OWN_ROOT_PREFIX}{os.getpid()}-", dir=base)
        return Path(self._own_root)

    def push(self, weights: WeightsIterator, version: int, deliver: Callable[[Manifest], Any]) -> tuple[Manifest, Any]:
        try:
            manifest = self.send(weights, version)
            return manifest, deliver(manifest)
        except BaseException:
            # a push that failed (a full disk, a refused load) leaves no copy of the weights behind
            folder = self._root() / f"v{version}"
            if folder != self._current:
                shutil.rmtree(folder, ignore_errors=True)
            raise

    def send(self, weights: WeightsIterator, version: int) -> Manifest:
        from safetensors.torch import save_file

        folder = self._root() / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        checksum = WeightsChecksum()
        names: list[str] = []
        files: list[dict] = []  # {"file", "names"}: safetensors lists a file's tensors sorted, not in order
        bucket: dict[str, Tensor] = {}
        used = 0

        def flush() -> None:
            nonlocal bucket, used
            if bucket:
                name = f"bucket-{len(files):05d}.safetensors"
                save_file(bucket, str(folder / name))
                files.append({"file": name, "names": list(bucket)})
                bucket, used = {}, 0

        for name, tensor in weights:
            data = tensor.detach().to("cpu").contiguous()
            checksum.update(name, data)
            names.append(name)
            size = data.numel() * data.element_size()
            if bucket and used + size > self.bucket_bytes:
                flush()
            bucket[name] = data.clone() if data.data_ptr() == tensor.data_ptr() else data  # own storage: no shared views
            used += size
        flush()
        return {"kind": self.kind, "path": str(folder), "files": files, "names": names,
                "checksum": checksum.hexdigest(), "tensors": checksum.tensors, "bytes": checksum.bytes}

    def sent(self, manifest: Manifest) -> None:
        current = Path(manifest["path"])
        if self._current is not None and self._current != current:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = current

    @staticmethod
    def receive(manifest: Manifest) -> Iterator[tuple[str, Tensor]]:
        from safetensors import safe_open

        folder = Path(manifest["path"])
        if not folder.is_dir():
            raise FileNotFoundError(f"weights folder {folder} does not exist on the server: the server must read the "
                                    "trainer's FolderTransport path (same machine, or a shared filesystem)")
        for entry in manifest["files"]:
            with safe_open(str(folder / entry["file"]), framework="pt") as handle:
                for name in entry["names"]:
                    yield name, handle.get_tensor(name)

    def close(self) -> None:
        if self._current is not None:
            shutil.rmtree(self._current, ignore_errors=True)
            self._current = None
        if self._own_root is not None:
            shutil.rmtree(self._own_root, ignore_errors=True)
            self._own_root = None


OWN_ROOT_PREFIX = "gspo-weights-"


def remove_dead_runs_folders(base: Path) -> list[Path]:
    """Remove this user's ``gspo-weights-<pid>-*`` folders in ``base`` whose process is gone
    (a run killed before it could clean up leaves a full copy of the weights, in RAM when
    ``base`` is ``/dev/shm``). A live process's folder, another user's, or one without a pid
    in its name is left alone. Returns the folders removed."""
    removed = []
    for folder in base.glob(f"{OWN_ROOT_PREFIX}*-*"):
        pid = folder.name[len(OWN_ROOT_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or not folder.is_dir() or folder.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)  # raises ProcessLookupError when no such process
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        except OSError:  # PermissionError: alive, another user's; or the folder went meanwhile
            continue
    return removed


class NCCLTransport(WeightTransport):
    """A NCCL broadcast from trainer rank 0 to a rollout server on a GPU (untested here).

    The trainer (rank 0 of a 2-member group) and the server (rank 1) meet at
    ``host:port`` through vLLM's ``StatelessProcessGroup``; tensors go one by one through
    ``PyNcclCommunicator.broadcast``, described (names, shapes, dtypes) by the manifest
    the server receives over HTTP before the broadcast starts.

    Args:
        host / port: where the trainer's rendezvous store listens (reachable by the server).
        device: the trainer's CUDA device for the broadcast.
    """

    kind = "nccl"

    def __init__(self, host: str = "127.0.0.1", port: int = 29555, device: int = 0):
        self.host, self.port, self.device = host, port, device
        self._communicator = None

    @staticmethod
    def _require_cuda() -> None:
        if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
            raise RuntimeError("NCCLTransport needs CUDA GPUs and NCCL on both the trainer and the server; on CPU "
                               "machines use gspo_lightning.rollout.transport.FolderTransport")
        try:
            import vllm.distributed.device_communicators.pynccl  # noqa: F401
        except ImportError as error:
            raise RuntimeError("NCCLTransport uses vLLM's PyNcclCommunicator: pip install -e '.[vllm]'") from error

    @staticmethod
    def _connect(host: str, port: int, rank: int, device: int):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=2)
        return PyNcclCommunicator(group, device=torch.device("cuda", device))

    def describe(self, weights: list[tuple[str, Tensor]], version: int) -> Manifest:
        checksum = WeightsChecksum()
        for name, tensor in weights:
            checksum.update(name, tensor)
        return {"kind": self.kind, "host": self.host, "port": self.port, "version": version,
                "names": [n for n, _ in weights], "shapes": [list(t.shape) for _, t in weights],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in weights],
                "checksum": checksum.hexdigest(), "tensors": checksum.tensors, "bytes": checksum.bytes}

    def send(self, weights: WeightsIterator, version: int) -> Manifest:
        # the weights are only described here; they move in push(), while the server receives
        self._require_cuda()
        self._pending = [(name, tensor.detach().to(f"cuda:{self.device}")) for name, tensor in weights]
        return self.describe(self._pending, version)

    def push(self, weights: WeightsIterator, version: int, post: Callable[[Manifest], Any]) -> tuple[Manifest, Any]:
        from concurrent.futures import ThreadPoolExecutor

        manifest = self.send(weights, version)
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(post, manifest)  # the server joins the group and receives
            if self._communicator is None:
                self._communicator = self._connect(self.host, self.port, 0, self.device)
            for _, tensor in self._pending:
                self._communicator.broadcast(tensor, src=0)
            self._pending = []
            return manifest, reply.result()

    @staticmethod
    def receive(manifest: Manifest) -> Iterator[tuple[str, Tensor]]:
        NCCLTransport._require_cuda()
        communicator = NCCLTransport._connect(manifest["host"], manifest["port"], 1, torch.cuda.current_device())
        for name, shape, dtype in zip(manifest["names"], manifest["shapes"], manifest["dtypes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
            communicator.broadcast(tensor, src=0)
            yield name, tensor


# the transports a server accepts, by manifest ``kind`` (never a class path from the network;
# never in-process: its manifest holds live tensors, not something sent over a wire)
RECEIVERS = {FolderTransport.kind: FolderTransport.receive, NCCLTransport.kind: NCCLTransport.receive}


__all__ = ["FolderTransport", "InProcessTransport", "NCCLTransport", "RECEIVERS", "WeightTransport", "WeightsChecksum",
           "checksum_of", "remove_dead_runs_folders"]
