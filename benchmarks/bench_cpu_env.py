"""CPU threads beside a busy process: the quickstart's step time with the `gspo` command's
settings (threads chosen by ``run/cpu_threads.py``) against fixed settings, on the machine as it
is and with a busy torch process of our own beside the run.

    python benchmarks/bench_cpu_env.py --steps 30 --repeats 2
    python benchmarks/bench_cpu_env.py --grid-cell 100-0.6M-16 --steps 12  # a cell of bench_grid.py
    python benchmarks/bench_cpu_env.py --config my_run.yaml --steps 10     # any run

Arms run alternately within each load condition; the result is each arm's median step time
and its ratio to the shipped arm's, in one run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = "import sys; from gspo_lightning.cli import main; sys.argv[0] = 'gspo'; main()"
BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(384, 384)\nwhile True:\n    a @ a"
# arm -> environment added to the clean one (no OpenMP variable: the `gspo` command's choice)
ARMS = {
    "shipped": {},
    "2 threads": {"OMP_NUM_THREADS": "2"},  # OpenMP's default wait policy (spin ~3 ms, then sleep)
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "passive, 2 threads": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2"},  # the `gspo` command before issue 41
    "passive, 1 thread": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"},
    "active, 2 threads": {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "2"},
}


def clean_env() -> dict[str, str]:
    """Our environment without OpenMP settings: torch picks its own thread count (all cores)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}  # benchmarks/: the grid's reward


def run_config(config: Path, extra_env: dict, steps: int, folder: Path) -> list[float]:
    env = {**clean_env(), **extra_env}
    args = ["fit", "--config", str(config), f"--trainer.max_steps={steps}",
            "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--model.export_on_fit_end=false",
            "--checkpoint.every_n_train_steps=0", f"--trainer.default_root_dir={folder}"]
    subprocess.run([sys.executable, "-c", LAUNCH, *args], cwd=folder, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = next(folder.rglob("metrics.csv"))
    with open(metrics) as handle:
        times = [float(r["time/step"]) for r in csv.DictReader(handle) if r.get("time/step")]
    return times[2:]  # the first steps warm up


def grid_cell_config(cell: str, folder: Path, seed: int = 0) -> Path:
    """The `gspo fit` config of one bench_grid.py cell (its model and prompts built in ``folder``)."""
    import yaml
    from _common import build_bench_model, write_prompts
    from bench_grid import GROUP, PROMPT_TOKENS, PROMPTS_PER_STEP, default_source, gspo_config

    vocab, size, length = cell.split("-")
    shape = build_bench_model(vocab, size, folder / "model", seed)
    prompts = folder / "prompts.jsonl"
    write_prompts(shape["tokenizer"], default_source(), prompts, PROMPT_TOKENS, PROMPTS_PER_STEP * GROUP)
    config = gspo_config(cell, folder / "model", prompts, folder, int(length), steps=10, seed=seed, profile=False, warmup=0)
    for key in ("logger", "callbacks", "default_root_dir"):  # the run's own CSV log, in a folder per run
        config["trainer"].pop(key)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs/quickstart.yaml")
    parser.add_argument("--grid-cell", help="instead of --config: a cell of bench_grid.py, VOCAB-SIZE-LENGTH (e.g. 100-0.6M-16)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.grid_cell:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        args.config = grid_cell_config(args.grid_cell, Path(tempfile.mkdtemp(prefix="bench_cpu_env_")))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_grid import stamp

    results = {"stamp": {**stamp(), "command": " ".join(["python", "benchmarks/bench_cpu_env.py", *sys.argv[1:]])},
               "grid_cell": args.grid_cell, "load_before": os.getloadavg(), "cores": os.cpu_count(), "config": str(args.config), "arms": args.arms}
    for load in ("as is", "busy neighbour"):
        busy = subprocess.Popen([sys.executable, "-c", BUSY], env=clean_env()) if load == "busy neighbour" else None
        try:
            time.sleep(1.0 if busy else 0.0)
            times = {name: [] for name in args.arms}
            for _ in range(args.repeats):
                for name in args.arms:
                    with tempfile.TemporaryDirectory() as folder:
                        times[name] += run_config(args.config.resolve(), ARMS[name], args.steps, Path(folder))
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        medians = {name: statistics.median(values) for name, values in times.items()}
        first = args.arms[0]
        results[load] = {"median_step_s": medians, f"over_{first}": {k: v / medians[first] for k, v in medians.items()},
                         "steps": {k: len(v) for k, v in times.items()}, "load_after": os.getloadavg()}
        cells = "  ".join(f"{name} {value:.3f} s ({value / medians[first]:.2f}x)" for name, value in medians.items())
        print(f"{load:15s} {cells}  (loadavg {os.getloadavg()[0]:.2f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
