"""How many CPU threads a run's torch uses: measured on the run's own first steps, then kept in
step with what other processes leave free.

Three facts measured on 2 cores (``docs/reliability.md``, "CPU threads"):

- whether a second thread pays depends on the work, not only on the model: the quickstart's
  0.08M model is as fast on one thread as on two (128 responses of 6 tokens), the same shape
  with 64 responses of 16-128 tokens after 48-token prompts is 1.2-1.4x faster on two. So a run
  whose steps are short (:data:`TRIAL_BELOW_STEP_S`) times a few steps on all its cores, then a
  few on one, and keeps one unless all cores are clearly faster (:data:`KEEP_MORE_IF`); a run
  with long steps (large operations, which split well) keeps all its cores without the trial;
- on all cores, OpenMP's default wait policy (a waiting thread spins a few ms before it sleeps)
  is the fastest alone, and 5-8x slower beside one busy process, when a spinning or descheduled
  thread holds up every parallel region. So the count follows the load: when this process's
  threads wait for a core (the kernel's per-thread run-queue delay, ``/proc/self/task/*/schedstat``)
  the count drops to this process's share of the cores; when other processes leave cores idle
  again (``/proc/stat``) it goes back up;
- one thread loses least beside a busy process: a run that chose one stays on one.

``OMP_NUM_THREADS`` set by the user always wins: the rule then does nothing. A count that follows
the load can change a float sum's order between two runs; pin it for bitwise-reproducible runs.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

# a run whose first timed step on all cores is shorter than this also times one thread: its operations
# may be too small to split, and a trial of a few steps costs little (a long step's operations split well)
TRIAL_BELOW_STEP_S = 1.0
# steps timed per count (at least, and over at least TRIAL_S), after the run's first step (warm-up)
TRIAL_STEPS = 3
TRIAL_S = 0.3
# all cores are kept only when their median step is under this share of one thread's
KEEP_MORE_IF = 0.9
# share of the threads' time spent waiting for a core above which the count drops
CONTENDED = 0.15
# decide over at least this much training time: /proc/stat counts in 10 ms ticks
WINDOW_S = 1.0


def usable_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 quota (``docker run
    --cpus=2`` sets a quota, not an affinity)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit readable: the affinity stands
    return max(1, cores)


def threads_for(cores: int, ranks_on_machine: int = 1) -> int:
    """The most threads a rank uses: its share of the cores."""
    return max(1, cores // max(1, ranks_on_machine))


def trial_verdict(step_s_most: list[float], step_s_one: list[float]) -> bool:
    """Whether all cores stay after the trial: their median step clearly under one thread's."""
    return statistics.median(step_s_most) < KEEP_MORE_IF * statistics.median(step_s_one)


def next_thread_count(current: int, most: int, cores: int, waiting: float, others_cores: float) -> int:
    """The count for the next steps, from the last window: ``waiting`` is the share of our threads'
    time spent runnable but not running, ``others_cores`` the cores other processes kept busy.
    Contended: keep the share of our threads that ran. Below the most: take the cores others left
    idle (half a core of slack, so a neighbour's short pauses do not make the count swing)."""
    if waiting > CONTENDED:
        return max(1, min(current - 1, round(current * (1.0 - waiting))))
    if current < most:
        idle = cores - others_cores - current
        if idle >= 0.5:
            return min(most, current + max(1, math.floor(idle)))
    return current


@dataclass
class CPUSample:
    wall_s: float
    waiting_ns: dict[int, int]  # run-queue delay of each of this process's threads, by thread id
    own_cpu_s: float  # CPU time of this process (all its threads)
    busy_cpu_s: float  # CPU time of the whole machine

    def waiting_since(self, earlier: "CPUSample") -> float:
        """Seconds this process's threads waited for a core since ``earlier``: threads present in both
        (a thread born meanwhile brings delay from before; one that ended takes its own away)."""
        return sum(ns - earlier.waiting_ns[tid] for tid, ns in self.waiting_ns.items() if tid in earlier.waiting_ns) / 1e9


def sample_cpu(proc: Path = Path("/proc")) -> Optional[CPUSample]:
    """The counters :func:`next_thread_count` needs, or None where ``/proc`` does not have them."""
    try:
        waiting = {}
        for task in (proc / "self" / "task").iterdir():
            try:
                waiting[int(task.name)] = int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that ended meanwhile
        fields = [int(v) for v in (proc / "stat").read_text().split("\n", 1)[0].split()[1:]]
        busy_ticks = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
        times = os.times()
        return CPUSample(time.perf_counter(), waiting, times.user + times.system, busy_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def user_sets_threads(environ: Mapping[str, str]) -> bool:
    """Whether the user chose the thread count (``OMP_NUM_THREADS``): then the rule stays out."""
    return bool(environ.get("OMP_NUM_THREADS", "").strip())


class CPUThreads(Callback):
    """Sets torch's thread count once the policy is built, before the first rollout (the engine
    starts after this callback's ``on_fit_start``): the rank's share of the cores. A run with short
    steps then times a few on one thread and keeps the faster count (printed with both times;
    logged once as ``cpu/trial_step_s_all`` and ``cpu/trial_step_s_one``). Above one thread, the count
    is re-decided from the load of each window of training steps (logged: ``cpu/threads``; per
    window ``cpu/wait_frac``, the share of our threads' time spent waiting for a core, and
    ``cpu/others_cores``, the cores others kept busy). The previous count comes back when the run
    ends: torch's count is the whole process's."""

    def __init__(self, environ: Optional[Mapping[str, str]] = None,
                 sample: Callable[[], Optional[CPUSample]] = sample_cpu) -> None:
        self.environ = os.environ if environ is None else environ
        self.sample = sample
        self.most = self.cores = 0
        self.previous: Optional[int] = None
        self.trial: Optional[dict[int, list[float]]] = None  # step seconds per count, while the trial runs
        self.steps_done = 0
        self.window: Optional[CPUSample] = None  # the window's start
        self.step_start: Optional[CPUSample] = None
        self.window_wall = self.window_waiting = 0.0

    def _apply(self, trainer, pl_module) -> None:
        import torch

        if self.previous is not None or pl_module.policy is None or user_sets_threads(self.environ):
            return
        self.cores = usable_cores()
        self.most = threads_for(self.cores, trainer.num_devices if trainer.num_devices > 0 else 1)
        self.trial = {self.most: [], 1: []} if self.most > 1 else None
        self.steps_done = 0
        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.most)
        rank_zero_info(f"CPU threads: {self.most} per rank ({self.cores} cores"
                       f"{'; the first steps time one thread against them' if self.trial else ''}; "
                       "OMP_NUM_THREADS=N sets it yourself)")

    def _trial_step(self, pl_module, threads: int, seconds: float) -> None:
        """One more step of the trial: all cores first, then one thread; then the verdict."""
        import torch

        self.steps_done += 1
        if self.steps_done == 1:
            return  # the run's first step warms allocators and caches: not timed
        times = self.trial[threads]
        times.append(seconds)
        if threads == self.most and seconds >= TRIAL_BELOW_STEP_S:
            self.trial = None  # long steps: large operations, which split well; no trial
            return
        if len(times) < TRIAL_STEPS or sum(times) < TRIAL_S:
            return
        if threads == self.most:
            torch.set_num_threads(1)
            return
        most_s, one_s = statistics.median(self.trial[self.most]), statistics.median(times)
        keep = trial_verdict(self.trial[self.most], times)
        torch.set_num_threads(self.most if keep else 1)
        rank_zero_info(f"CPU threads: {self.most if keep else 1} per rank (a step took {most_s:.3f} s on {self.most} "
                       f"threads, {one_s:.3f} s on 1)")
        pl_module.log_dict({"cpu/trial_step_s_all": most_s, "cpu/trial_step_s_one": one_s}, on_step=True, on_epoch=False)
        if not keep:
            self.most = 1  # one thread also loses least beside a busy process: it stays
        self.trial = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self._apply(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._apply(trainer, pl_module)

    def on_test_start(self, trainer, pl_module) -> None:
        self._apply(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.most > 1:
            self.step_start = self.sample()
            if self.trial is None:
                self.window = self.window or self.step_start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch

        if self.most <= 1 or self.step_start is None:
            return
        end = self.sample()
        if end is None:
            self.most = 0  # no counters here: keep the count as it is
            return
        threads = torch.get_num_threads()
        if self.trial is not None:
            self._trial_step(pl_module, threads, end.wall_s - self.step_start.wall_s)
            pl_module.log("cpu/threads", float(threads), on_step=True, on_epoch=False)
            return
        self.window_wall += end.wall_s - self.step_start.wall_s
        self.window_waiting += end.waiting_since(self.step_start)
        if self.window_wall >= WINDOW_S:
            wall = end.wall_s - self.window.wall_s  # others' load over the whole window, steps and gaps
            others = max(0.0, (end.busy_cpu_s - self.window.busy_cpu_s) - (end.own_cpu_s - self.window.own_cpu_s)) / wall
            waiting = min(1.0, max(0.0, self.window_waiting / (self.window_wall * threads)))
            chosen = next_thread_count(threads, self.most, self.cores, waiting, others)
            if chosen != threads:
                torch.set_num_threads(chosen)
            pl_module.log_dict({"cpu/wait_frac": waiting, "cpu/others_cores": others}, on_step=True, on_epoch=False)
            self.window, self.window_wall, self.window_waiting = None, 0.0, 0.0
        pl_module.log("cpu/threads", float(torch.get_num_threads()), on_step=True, on_epoch=False)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        import torch

        if self.previous is not None and torch.get_num_threads() != self.previous:
            torch.set_num_threads(self.previous)
        self.previous, self.most, self.window, self.trial = None, 0, None, None


__all__ = ["CPUThreads", "next_thread_count", "sample_cpu", "threads_for", "trial_verdict",
           "usable_cores", "user_sets_threads"]
