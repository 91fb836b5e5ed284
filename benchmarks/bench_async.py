"""Asynchronous GSPO on 2 cores: the quickstart synchronous vs ``max_staleness: 1``, run through
``gspo fit`` as users run it, arms taking turns per seed (results: docs/async.md, "Measured").

    python benchmarks/bench_async.py --seeds 0 1 2 --json async_speed.json

Arms (the quickstart's task, model, sizes and 150 rollout steps in all of them):

- ``sync``: ``configs/quickstart.yaml`` as shipped (threads: torch's default, the machine's cores);
- ``sync-1t``: the same with ``OMP_NUM_THREADS=1`` (on this tiny model one thread is the faster
  synchronous setting: each kernel is too small to split);
- ``server-sync``: ``configs/quickstart_server.yaml`` (a rollout server process with one thread,
  the trainer with one: a core each), ``max_staleness: 0``;
- ``server-k1``: the same with ``max_staleness: 1`` and ``off_policy: {mode: decoupled}``: the
  server generates step t+1's rollout while the trainer trains on step t's.

Per arm and seed: median ``time/step`` over steps 10 onwards, the run's wall time, the last
tenth's mean training reward and the final held-out accuracy (greedy). The ratio against
``sync-1t`` and ``server-sync``, taken in the same invocation, is the number to keep: the hosts
here are shared and drift. The load is printed before each run.
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

ARMS = {
    "sync": ("configs/quickstart.yaml", {}, []),
    "sync-1t": ("configs/quickstart.yaml", {"OMP_NUM_THREADS": "1"}, []),
    "server-sync": ("configs/quickstart_server.yaml", {"OMP_NUM_THREADS": "1"}, []),
    "server-k1": ("configs/quickstart_server.yaml", {"OMP_NUM_THREADS": "1"},
                  ["--model.max_staleness=1", "--model.off_policy.mode=decoupled"]),
}


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def run_arm(arm: str, seed: int, steps: int, workdir: Path) -> dict:
    config, env_extra, overrides = ARMS[arm]
    root = workdir / f"{arm}-seed{seed}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / config),
               f"--seed_everything={seed}", f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root}",
               "--trainer.enable_progress_bar=false", "--model.export_on_fit_end=false",
               "--trainer.enable_checkpointing=false", *overrides]
    before = load()
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=workdir)
    wall = time.perf_counter() - start
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
    return {"arm": arm, "seed": seed, "load_before": before, "wall_s": round(wall, 2),
            "step_s": round(statistics.median(step_s[10:]), 4),
            "generate_s": round(statistics.median(float(r["time/generate"]) for r in train[10:] if r.get("time/generate")), 4),
            "last_tenth_reward": round(sum(rewards[-tail:]) / tail, 4),
            "heldout_accuracy": accuracy[0] if accuracy else None}


def report(runs: list[dict], arms: list[str]) -> str:
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in arms}
    median_step = {arm: statistics.median(r["step_s"] for r in rs) for arm, rs in by_arm.items() if rs}
    lines = ["| arm | step s (median over seeds) | vs sync-1t | vs server-sync | wall s | last-tenth reward | held-out accuracy |",
             "|---|---|---|---|---|---|---|"]
    for arm, rs in by_arm.items():
        if not rs:
            continue
        ratio = lambda base: f"{median_step[arm] / median_step[base]:.2f}x" if base in median_step else "-"  # noqa: E731
        lines.append(f"| {arm} | {median_step[arm]:.4f} ({', '.join(format(r['step_s'], '.4f') for r in rs)}) | "
                     f"{ratio('sync-1t')} | {ratio('server-sync')} | {statistics.median(r['wall_s'] for r in rs):.1f} | "
                     f"{', '.join(format(r['last_tenth_reward'], '.3f') for r in rs)} | "
                     f"{', '.join(str(r['heldout_accuracy']) for r in rs)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150, help="rollout steps per run (the quickstart's 150)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="gspo-bench-async-"))
    runs = []
    try:
        for seed in args.seeds:
            for arm in args.arms:
                runs.append(run_arm(arm, seed, args.steps, workdir))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table = report(runs, args.arms)
    info = stamp()
    info["command"] = " ".join(["python", "benchmarks/bench_async.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"\ncommit {info['commit']} · {info['date']} · {info['cpu']} ({info['cpus']} cpus) · load {load()}\n")
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"stamp": info, "runs": runs, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
