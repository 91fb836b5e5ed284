"""Does a change leave training exactly as it was? Runs the same ``gspo fit`` jobs with the code
of a base commit and with the working tree, then compares the exported weights (bit for bit)
and every logged value that is not a timing (``time/*``, ``perf/*``, ``cpu/*``), row by row.

    python scripts/same_run.py --base f571599                    # the quickstart and a 12-step async run
    python scripts/same_run.py --base HEAD~1 --jobs async --out runs/same_run

For refactors, which must change nothing: it exits 1 on any difference. Each tree runs with its
own configs and its own package (``PYTHONPATH``), in one process at a time.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_BAR = ["--trainer.enable_progress_bar=false"]
JOBS = {
    # the CPU quickstart as shipped: 150 steps, synchronous
    "quickstart": ["--config", "configs/quickstart.yaml"],
    # (flat model keys: a base from before the config blocks reads them too, and today's maps them)
    # asynchronous: two steps generated ahead on a float32 engine copy, decoupled off-policy correction
    # and the clip budget on, another seed, evaluations every 5 steps
    "async": ["--config", "configs/quickstart.yaml", "--model.max_staleness=2",
              "--model.engine=gspo_lightning.rollout.HFCopyEngine", "--model.engine.dtype=float32",
              "--model.off_policy.mode=decoupled", "--trainer.max_steps=12", "--seed_everything=7",
              "--trainer.val_check_interval=5"],
}
# timings, and the CPU-thread rule's trial (cpu/*: step times and other processes' load it measured)
TIMING_PREFIXES = ("time/", "perf/", "cpu/")


def run_job(tree: Path, job: str, out: Path) -> Path:
    """``gspo fit`` of ``job`` with the package and configs of ``tree``; returns the run folder."""
    folder = out / job
    args = [a if not a.startswith("configs/") else str(tree / a) for a in JOBS[job]]
    command = [sys.executable, "-m", "gspo_lightning.cli", "fit", *args, *NO_BAR, f"--trainer.default_root_dir={folder}"]
    # the thread count fixed for both trees: the CPU-thread rule times trial steps, and a loaded machine
    # can make it choose 1 thread in one run and 2 in the other (a difference of the machine, not the code)
    env = {"OMP_NUM_THREADS": str(os.cpu_count() or 1), **os.environ, "PYTHONPATH": str(tree)}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{job}.log", "w") as log:
        subprocess.run(command, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return folder / "csv" / "version_0"


def compare(base: Path, head: Path) -> list[str]:
    """Every difference between two run folders: weights bitwise, then non-timing metrics."""
    import torch
    from safetensors.torch import load_file

    problems = []
    weights = [load_file(str(folder / "hf_model" / "model.safetensors")) for folder in (base, head)]
    if weights[0].keys() != weights[1].keys():
        problems.append(f"exported tensors differ: {sorted(weights[0].keys() ^ weights[1].keys())}")
    for name in sorted(weights[0].keys() & weights[1].keys()):
        a, b = weights[0][name], weights[1][name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)):
            problems.append(f"weight {name} differs")
    rows = [list(csv.DictReader(open(folder / "metrics.csv"))) for folder in (base, head)]
    if len(rows[0]) != len(rows[1]) or set(rows[0][0]) != set(rows[1][0]):
        problems.append(f"metrics.csv: {len(rows[0])} vs {len(rows[1])} rows, columns "
                        f"{sorted(set(rows[0][0]) ^ set(rows[1][0]))} in one only")
    for index, (a, b) in enumerate(zip(*rows)):
        for key in a:
            if not key.startswith(TIMING_PREFIXES) and a.get(key) != b.get(key):
                problems.append(f"metrics.csv row {index} {key}: {a.get(key)} vs {b.get(key)}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare the working tree against")
    parser.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=sorted(JOBS, reverse=True))
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary folder)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="same_run-"))
    base_tree = out / "base-tree"
    if not base_tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), args.base], check=True,
                       capture_output=True)
    commit = subprocess.run(["git", "-C", str(base_tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    failed = False
    try:
        for job in args.jobs:
            problems = compare(run_job(base_tree, job, out / "base"), run_job(ROOT, job, out / "head"))
            print(f"{job}: {'identical' if not problems else f'{len(problems)} differences'} "
                  f"(base {commit} vs the working tree; weights bitwise, metrics.csv without time/, perf/ and cpu/)")
            for line in problems[:20]:
                print("  " + line)
            failed |= bool(problems)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], capture_output=True)
    print(f"runs in {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
