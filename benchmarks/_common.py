"""Pieces both benchmark children share: the reward, the prompts, memory and timing probes.

Nothing here imports gspo_lightning or trl at module level, so either child pays only for
its own framework's imports.
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class BenchConfig:
    """One measurement: the same numbers go to gspo-lightning and to TRL."""

    size: str
    model_dir: str  # a saved Hugging Face folder (built once by the parent)
    prompts_file: str  # jsonl with a "prompt" column, already filtered to <= max_prompt_tokens
    prompts_per_step: int
    group_size: int
    response_length: int
    steps: int
    warmup: int
    lr: float = 1e-6
    threads: int = 2
    seed: int = 0
    out_dir: str = ""
    cprofile: str = ""  # gspo child only: write a cProfile of the measured steps here
    gspo_overrides: dict = field(default_factory=dict)  # extra GSPOModule arguments (experiments)
    gspo_patch: str = ""  # a Python file the gspo child runs before building the module (experiments)

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str) -> "BenchConfig":
        return cls(**json.loads(Path(path).read_text()))


def bench_reward(prompts, completions, **kwargs) -> list[float]:
    """Deterministic and cheap: the share of digit characters in the completion.

    Random policies give different values inside a group, so advantages are non-zero and
    both trainers do a real update (TRL and gspo-lightning call it the same way)."""
    return [sum(ch.isdigit() for ch in text) / (1 + len(text)) for text in completions]


def write_prompts(tokenizer, source: str, out: Path, max_tokens: int, count: int) -> dict:
    """The first ``count`` GSM8K questions of at most ``max_tokens`` tokens, as ``{"prompt": q}`` rows."""
    rows, lengths = [], []
    with open(source) as handle:
        for line in handle:
            question = json.loads(line)["question"]
            n = len(tokenizer(question, add_special_tokens=False)["input_ids"])
            if n <= max_tokens:
                rows.append({"prompt": question})
                lengths.append(n)
            if len(rows) == count:
                break
    with open(out, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return {"prompts": len(rows), "prompt_tokens_mean": statistics.mean(lengths), "prompt_tokens_max": max(lengths)}


# -- contention ------------------------------------------------------------------------
def machine_busy_s() -> float:
    """CPU seconds all processes of the machine have used (from /proc/stat), all cores together."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return float("nan")
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class StepClock:
    """Wall time, own CPU time, and the CPU time other processes took, per step.

    The machine is shared: when other processes run during a step, the step is slower for
    reasons that have nothing to do with the framework. ``contention`` is the share of
    all cores that other processes used during the step; the parent reports medians over
    the steps where it stayed low (and over all steps)."""

    def __init__(self) -> None:
        self.ncpu = os.cpu_count() or 1
        self.mark()

    def mark(self) -> None:
        import time

        self.wall, self.cpu, self.busy = time.perf_counter(), time.process_time(), machine_busy_s()

    def lap(self, result: "ChildResult") -> None:
        import time

        wall, cpu, busy = time.perf_counter() - self.wall, time.process_time() - self.cpu, machine_busy_s() - self.busy
        result.step_wall_s.append(wall)
        result.step_cpu_s.append(cpu)
        other = max(0.0, busy - cpu)
        result.step_contention.append(other / (wall * self.ncpu) if wall > 0 else 0.0)


# -- memory ------------------------------------------------------------------------------
def _status_kib(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """VmHWM (since the last reset), falling back to ru_maxrss."""
    hwm = _status_kib("VmHWM")
    return hwm / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class ChildResult:
    framework: str
    size: str
    step_wall_s: list[float] = field(default_factory=list)  # per optimizer step, end-to-end
    step_cpu_s: list[float] = field(default_factory=list)  # process CPU time (all threads) per step
    step_contention: list[float] = field(default_factory=list)  # share of the cores other processes used
    phases: dict[str, list[float]] = field(default_factory=dict)  # phase -> per-step seconds
    response_length_mean: list[float] = field(default_factory=list)
    baseline_rss_mib: float = 0.0  # after model load / trainer setup, before the first step
    load_peak_rss_mib: float = 0.0  # high-water mark of imports, loading and setup (before step 1)
    train_peak_rss_mib: float = 0.0  # high-water mark from the first step to the last
    rollout_peak_rss_mib: list[float] = field(default_factory=list)  # per step: generate + score + batch building
    update_peak_rss_mib: list[float] = field(default_factory=list)  # per step: log-prob passes + update
    process_peak_rss_mib: float = 0.0  # max(load_peak_rss_mib, train_peak_rss_mib)
    peak_reset: bool = False
    setup_s: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def add_phase(self, name: str, value: float) -> None:
        self.phases.setdefault(name, []).append(float(value))

    def finish_memory(self) -> None:
        self.train_peak_rss_mib = max([peak_rss_mib(), *self.rollout_peak_rss_mib, *self.update_peak_rss_mib])

    def write(self, out_dir: str) -> None:
        # (ru_maxrss is reset together with VmHWM, so it cannot give the whole-process peak)
        self.process_peak_rss_mib = max(self.load_peak_rss_mib, self.train_peak_rss_mib)
        Path(out_dir, "result.json").write_text(json.dumps(asdict(self), indent=1))


def versions() -> dict[str, str]:
    import platform

    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "torch_threads": str(torch.get_num_threads()), "cpu_count": str(os.cpu_count())}
    for name in ("lightning", "trl", "accelerate"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out
