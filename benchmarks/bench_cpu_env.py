"""OpenMP's wait policy beside a busy process: the quickstart's step time with torch's
default settings and with the `gspo` command's (``OMP_WAIT_POLICY=PASSIVE``), on the
machine as it is and with a busy torch process of our own beside the run.

    python benchmarks/bench_cpu_env.py --steps 12 --repeats 2

Runs alternate (default, passive) within each load condition; the result is the ratio of
median step times in one run. "default" is the OpenMP runtime with no wait policy set (the
run imports torch before the CLI sets one), the behaviour before the `gspo` command set it.
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
# torch loaded before the CLI: the runtime starts with no wait policy (as before run/cpu_env.py)
DEFAULT_LAUNCH = "import sys, torch; from gspo_lightning.cli import main; sys.argv[0] = 'gspo'; main()"
PASSIVE_LAUNCH = "import sys; from gspo_lightning.cli import main; sys.argv[0] = 'gspo'; main()"
BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(384, 384)\nwhile True:\n    a @ a"


def clean_env() -> dict[str, str]:
    """Our environment without OpenMP settings: torch picks its own thread count (all cores)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    return {**env, "PYTHONPATH": str(ROOT)}


def run_quickstart(launch: str, steps: int, folder: Path) -> list[float]:
    env = clean_env()
    args = ["fit", "--config", str(ROOT / "configs/quickstart.yaml"), f"--trainer.max_steps={steps}",
            "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--model.export_on_fit_end=false",
            "--checkpoint.every_n_train_steps=0", f"--trainer.default_root_dir={folder}"]
    subprocess.run([sys.executable, "-c", launch, *args], cwd=folder, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = next(folder.rglob("metrics.csv"))
    with open(metrics) as handle:
        times = [float(r["time/step"]) for r in csv.DictReader(handle) if r.get("time/step")]
    return times[2:]  # the first steps warm up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {"load_before": os.getloadavg(), "cores": os.cpu_count()}
    for load in ("as is", "busy neighbour"):
        busy = subprocess.Popen([sys.executable, "-c", BUSY], env=clean_env()) if load == "busy neighbour" else None
        try:
            time.sleep(1.0 if busy else 0.0)
            times = {"default": [], "passive": []}
            for _ in range(args.repeats):
                for name, launch in (("default", DEFAULT_LAUNCH), ("passive", PASSIVE_LAUNCH)):
                    with tempfile.TemporaryDirectory() as folder:
                        times[name] += run_quickstart(launch, args.steps, Path(folder))
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        medians = {name: statistics.median(values) for name, values in times.items()}
        results[load] = {"median_step_s": medians, "passive_over_default": medians["passive"] / medians["default"],
                         "steps": {k: len(v) for k, v in times.items()}, "load_after": os.getloadavg()}
        print(f"{load:15s} default {medians['default']:.3f} s/step  passive {medians['passive']:.3f} s/step  "
              f"passive/default {medians['passive'] / medians['default']:.2f}  (loadavg {os.getloadavg()[0]:.2f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
