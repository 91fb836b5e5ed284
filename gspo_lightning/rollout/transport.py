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
import stat
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from gspo_lightning.errors import ConfigError
from gspo_lightning.rollout.engine import WeightsIterator

if TYPE_CHECKING:
    from concurrent.futures import Future

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
    where the engine is (this process, or a rollout server: :meth:`receiver` makes its side)."""

    kind: str = ""
    # whether a manifest can be loaded again later (a restarted server gets the last push):
    # a folder's files stay until the next push, a broadcast is gone once received
    resendable: bool = True

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

    @abstractmethod
    def receive(self, manifest: Manifest) -> Iterator[tuple[str, Tensor]]:
        """The receiving side: the pushed ``(name, tensor)`` pairs, in order."""

    @classmethod
    def receiver(cls, weights_root: str) -> "WeightTransport":
        """The receiving side in a rollout server, which reads files only under ``weights_root``;
        one per trainer session (it may keep a connection to that trainer)."""
        return cls()

    def close(self) -> None:
        """End of the run: remove what the transport wrote."""


class InProcessTransport(WeightTransport):
    """The engine lives in this process: the manifest carries the ``(name, tensor)`` iterator
    itself, so the engine reads the policy's weights as they are gathered, with no copy."""

    kind = "in-process"

    def send(self, weights: WeightsIterator, version: int) -> Manifest:
        return {"kind": self.kind, "version": version, "weights": weights}

    def receive(self, manifest: Manifest) -> Iterator[tuple[str, Tensor]]:
        return iter(manifest["weights"])


def default_weights_root() -> Path:
    """Where a :class:`FolderTransport` without a ``path`` writes (``/dev/shm`` when it exists,
    RAM-backed; else the temporary directory), and so where a server reads by default."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return Path("/dev/shm")
    return Path(tempfile.gettempdir())


def _strictly_inside(path: Path, root: Path) -> bool:
    return root in path.parents


class FolderTransport(WeightTransport):
    """safetensors buckets of at most ``bucket_mb`` MiB in ``path/v<version>/``.

    Args:
        path: a folder the server can read (``null``: a fresh folder in ``/dev/shm`` when it
            exists, else in the temporary directory; across nodes give a shared filesystem).
            On the receiving side, the only folder whose subfolders it reads.
        bucket_mb: largest bucket file; buckets are written as the weights stream in, so the
            trainer never holds more than one bucket beyond its own weights.
    """

    kind = "folder"

    def __init__(self, path: Optional[str] = None, bucket_mb: float = 256.0):
        if bucket_mb <= 0:
            raise ConfigError(f"FolderTransport bucket_mb must be > 0, got {bucket_mb}")
        self.path = path
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._own_root: Optional[str] = None
        self._current: Optional[Path] = None

    @classmethod
    def receiver(cls, weights_root: str) -> "FolderTransport":
        return cls(path=weights_root)

    def _root(self) -> Path:
        if self.path is not None:
            Path(self.path).mkdir(parents=True, exist_ok=True)
            return Path(self.path).resolve()  # the server may run in another working directory
        if self._own_root is None:
            base = Path(default_weights_root())
            remove_dead_runs_folders(base)
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

    # -- the receiving side: only files inside the manifest's folder, only under the root --------
    def receiving_roots(self) -> tuple[Path, Path]:
        """The root as named, and resolved (``/tmp`` may be a link)."""
        named = Path(os.path.abspath(self.path if self.path is not None else default_weights_root()))
        return named, Path(os.path.realpath(named))

    def folder_of(self, manifest: Manifest) -> Path:
        """The manifest's folder, resolved, when it lies under the receiving root.

        One refusal for every other case (missing, outside, a link out, not a folder): it
        tells a client nothing about what exists elsewhere. Nothing outside the root is
        looked at unless a link inside the root points there."""
        named, root = self.receiving_roots()
        given = manifest.get("path")
        refusal = ValueError(
            f"weights folder {str(given)[:200]!r} is not a folder under this server's weights root {named}: the trainer's "
            "FolderTransport path must be the server's --weights_root (default /dev/shm, else the temporary directory), "
            "on this machine or a shared filesystem")
        if not isinstance(given, str) or "\x00" in given or not os.path.isabs(given) or ".." in Path(given).parts:
            raise refusal
        lexical = Path(os.path.normpath(given))
        if not (_strictly_inside(lexical, named) or _strictly_inside(lexical, root)):
            raise refusal
        real = Path(os.path.realpath(lexical))
        if not _strictly_inside(real, root) or not real.is_dir():
            raise refusal
        status = real.stat()
        if status.st_uid != os.getuid() or status.st_mode & 0o022:
            # /dev/shm is everyone's: a folder another user made (or may write into) is not the trainer's
            raise ConfigError(f"weights folder {str(given)[:200]!r} belongs to another user or others may write into it "
                             f"(owner uid {status.st_uid}, mode {oct(status.st_mode & 0o777)}): a server loads only weights "
                             "its own user wrote, in folders nobody else can change (a FolderTransport makes them so)")
        return real

    def receive(self, manifest: Manifest) -> Iterator[tuple[str, Tensor]]:
        # the folder and the file names are checked now, before the caller lets go of anything
        folder = self.folder_of(manifest)
        files = manifest.get("files")
        if not isinstance(files, list) or not all(isinstance(e, dict) for e in files):
            raise ConfigError("manifest.files must list the bucket files ({file, names})")
        for entry in files:
            names = entry.get("names")
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ConfigError("every manifest.files entry needs names, a list of tensor names")
            _check_bucket_name(entry.get("file"))
        return self._read(folder, files)

    @staticmethod
    def _read(folder: Path, files: list[dict]) -> Iterator[tuple[str, Tensor]]:
        from safetensors import safe_open

        for entry in files:
            name = entry["file"]
            fd = _open_bucket(folder, name)
            try:
                # through the open descriptor: a link swapped in after the check is not followed
                where = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(folder / name)
                with safe_open(where, framework="pt") as handle:
                    held = set(handle.keys())
                    for tensor_name in entry["names"]:
                        if tensor_name not in held:
                            raise ConfigError(f"bucket file {name!r} holds no tensor {tensor_name[:200]!r}")
                        yield tensor_name, handle.get_tensor(tensor_name)
            finally:
                os.close(fd)

    def close(self) -> None:
        if self._current is not None:
            shutil.rmtree(self._current, ignore_errors=True)
            self._current = None
        if self._own_root is not None:
            shutil.rmtree(self._own_root, ignore_errors=True)
            self._own_root = None


def read_safetensors_folder(weights_root: str, path: Any) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of the ``*.safetensors`` files in ``path`` (a folder as vLLM's
    ``reload_weights`` reads one), under the same rules as a pushed folder: strictly inside
    ``weights_root``, owned by this user, writable by nobody else, files read through
    descriptors that follow no link. Checked now; read as the iterator is consumed."""
    folder = FolderTransport(path=weights_root).folder_of({"path": path})
    files = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"weights folder {str(path)[:200]!r} holds no .safetensors file")
    descriptors: list[int] = []
    try:
        for name in files:  # every file opened (links refused) before anything is read
            descriptors.append(_open_bucket(folder, name))
    except BaseException:
        for fd in descriptors:
            os.close(fd)
        raise
    return _read_descriptors(folder, files, descriptors)


def _read_descriptors(folder: Path, files: list[str], descriptors: list[int]) -> Iterator[tuple[str, Tensor]]:
    from safetensors import safe_open

    try:
        for name, fd in zip(files, descriptors):
            where = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(folder / name)
            with safe_open(where, framework="pt") as handle:
                for tensor_name in handle.keys():
                    yield tensor_name, handle.get_tensor(tensor_name)
    finally:
        for fd in descriptors:
            os.close(fd)


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


def _bucket_refusal(name: Any) -> ValueError:
    return ValueError(f"bucket file {str(name)[:200]!r} of the manifest is not a regular file in the weights folder")


def _check_bucket_name(name: Any) -> None:
    """A bucket file is named by a plain file name: no folder part, no ``..``."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\x00" in name or os.path.basename(name) != name \
            or os.sep in name or (os.altsep and os.altsep in name):
        raise _bucket_refusal(name)


def _open_bucket(folder: Path, name: str) -> int:
    """A read descriptor of the regular file ``name`` right in ``folder`` (a link is refused)."""
    _check_bucket_name(name)
    try:
        fd = os.open(folder / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        raise _bucket_refusal(name) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _bucket_refusal(name)
    return fd


NCCL_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")


class NCCLTransport(WeightTransport):
    """A NCCL broadcast from trainer rank 0 to a rollout server on a GPU (untested here: no GPU).

    The trainer (rank 0 of a 2-member group) and the server (rank 1) meet at
    ``host:port`` through vLLM's ``StatelessProcessGroup``; tensors go one by one through
    ``PyNcclCommunicator.broadcast``, described (names, shapes, dtypes) by the manifest
    the server receives over HTTP before the broadcast starts. Both sides build the
    communicator once, at the first push, and keep it: the server one per trainer session
    (a new session, a new communicator). The rendezvous unpickles what the other side
    sends: only an authenticated trainer can make a server join one (docs/scaling.md#security).

    Args:
        host / port: where the trainer's rendezvous store listens (reachable by the server).
        device: the trainer's CUDA device for the broadcast.
        connect_timeout_s: how long either side waits for the other at the rendezvous.
    """

    kind = "nccl"
    resendable = False  # the tensors are gone once broadcast: a restarted server cannot be re-pushed

    def __init__(self, host: str = "127.0.0.1", port: int = 29555, device: int = 0, connect_timeout_s: float = 120.0):
        self.host, self.port, self.device, self.connect_timeout_s = host, port, device, connect_timeout_s
        self._communicator = None
        self._peer: Optional[tuple[str, int]] = None  # the receiving side's rendezvous

    @staticmethod
    def _require_cuda() -> None:
        if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
            raise RuntimeError("NCCLTransport needs CUDA GPUs and NCCL on both the trainer and the server; on CPU "
                               "machines use gspo_lightning.rollout.transport.FolderTransport")
        try:
            import vllm.distributed.device_communicators.pynccl  # noqa: F401
        except ImportError as error:
            raise RuntimeError("NCCLTransport uses vLLM's PyNcclCommunicator: pip install -e '.[vllm]'") from error

    def _connect(self, host: str, port: int, rank: int, device: int):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=2,
                                             store_timeout=int(self.connect_timeout_s))
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
        pool = ThreadPoolExecutor(1)
        try:
            reply = pool.submit(post, manifest)  # the server joins the group and receives
            if self._communicator is None:
                self._communicator = connect_unless_refused(
                    lambda: self._connect(self.host, self.port, 0, self.device), reply, self.connect_timeout_s)
            for _, tensor in self._pending:
                self._communicator.broadcast(tensor, src=0)
            self._pending = []
            return manifest, reply.result()
        finally:
            pool.shutdown(wait=False)

    receive_device = "cuda"  # where received tensors are made (a test on CPU sets "cpu")

    def receive(self, manifest: Manifest) -> Iterator[tuple[str, Tensor]]:
        self._require_cuda()
        layout = nccl_layout(manifest)  # checked before the server joins anything
        return self._receive((manifest["host"], manifest["port"]), *layout)

    def _receive(self, peer: tuple[str, int], names: list[str], shapes: list[list[int]],
                 dtypes: list[str]) -> Iterator[tuple[str, Tensor]]:
        if self._communicator is None or self._peer != peer:  # one communicator per session (and trainer address)
            self._communicator = self._connect(*peer, 1, torch.cuda.current_device() if self.receive_device == "cuda" else 0)
            self._peer = peer
        for name, shape, dtype in zip(names, shapes, dtypes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.receive_device)
            self._communicator.broadcast(tensor, src=0)
            yield name, tensor


def nccl_layout(manifest: Manifest) -> tuple[list[str], list[list[int]], list[str]]:
    """A NCCL manifest's rendezvous and tensors, checked before the server joins anything."""
    host, port = manifest.get("host"), manifest.get("port")
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError("a NCCL manifest needs host (a name) and port (1-65535) of the trainer's rendezvous")
    names, shapes, dtypes = manifest.get("names"), manifest.get("shapes"), manifest.get("dtypes")
    if not (isinstance(names, list) and isinstance(shapes, list) and isinstance(dtypes, list)
            and len(names) == len(shapes) == len(dtypes)):
        raise ConfigError("a NCCL manifest needs names, shapes and dtypes, lists of one length")
    for name, shape, dtype in zip(names, shapes, dtypes):
        if not isinstance(name, str) or dtype not in NCCL_DTYPES or not isinstance(shape, list) \
                or not all(type(d) is int and d >= 0 for d in shape):
            raise ConfigError(f"NCCL manifest entry {str(name)[:200]!r}: shape must be a list of sizes >= 0 and dtype one "
                             f"of {NCCL_DTYPES}")
    return names, shapes, dtypes


def connect_unless_refused(connect: Callable[[], Any], reply: "Future", timeout_s: float, poll_s: float = 0.05):
    """``connect()`` (a rendezvous that waits for the other side), given up as soon as ``reply``
    (the server's answer to the push) fails: a refused push (no secret, another trainer, a bad
    manifest) fails in moments, not after the rendezvous timeout. The abandoned rendezvous
    thread ends at its own timeout."""
    result: dict[str, Any] = {}
    done = threading.Event()

    def attempt() -> None:
        try:
            result["value"] = connect()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            result["error"] = error
        done.set()

    threading.Thread(target=attempt, name="nccl-rendezvous", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(poll_s):
        if reply.done() and reply.exception() is not None:
            raise reply.exception()
        if reply.done():
            raise RuntimeError("the server answered the NCCL push before joining the broadcast")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not join the NCCL rendezvous within {timeout_s:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


# the transports a server accepts, by manifest ``kind`` (never a class path from the network;
# never in-process: its manifest holds live tensors, not something sent over a wire)
RECEIVERS: dict[str, type[WeightTransport]] = {FolderTransport.kind: FolderTransport, NCCLTransport.kind: NCCLTransport}


__all__ = ["FolderTransport", "InProcessTransport", "NCCLTransport", "RECEIVERS", "read_safetensors_folder", "WeightTransport", "WeightsChecksum",
           "checksum_of", "connect_unless_refused", "default_weights_root", "nccl_layout", "remove_dead_runs_folders"]
