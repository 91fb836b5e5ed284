"""Run the CPU quickstart for several seeds and report the numbers in docs/quickstart.md:
the mean training reward of the first and last tenth of the rollout steps, the held-out
accuracy (greedy) of the untrained model (the validation before training, step 0) and of the
trained one (the last validation), and the wall time of the whole ``gspo fit`` command.

    python scripts/quickstart_seeds.py --seeds 0 1 2
"""

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml


def rewards(folder: Path) -> list[float]:
    metrics = sorted(folder.glob("csv/version_*/metrics.csv"))[-1]
    with open(metrics) as handle:
        return [float(row["reward/mean"]) for row in csv.DictReader(handle) if row.get("reward/mean")]


def held_out_accuracy(folder: Path) -> tuple[float, float]:
    """(before training, after training) from the run's held-out accuracy curve."""
    history = json.loads(sorted(folder.glob("csv/version_*/history.json"))[-1].read_text())
    curve = dict(history["val/accuracy"])
    return curve[0], curve[max(curve)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--out", default="runs/quickstart_seeds")
    args = parser.parse_args()
    print(f"{'seed':>4} {'steps':>5} {'reward first 10%':>16} {'last 10%':>8} "
          f"{'held-out acc before':>19} {'after':>5} {'fit seconds':>11}")
    for seed in args.seeds:
        folder = Path(args.out) / f"seed{seed}"
        config = yaml.safe_load(Path(args.config).read_text())
        config["seed_everything"] = seed
        # the run folder: the loggers and checkpoints follow default_root_dir
        config["trainer"].update(default_root_dir=str(folder), enable_progress_bar=False)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        start = time.time()
        subprocess.run([sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(path)],
                       check=True, capture_output=True)
        seconds = time.time() - start
        before, after = held_out_accuracy(folder)
        values = rewards(folder)
        tenth = max(1, len(values) // 10)
        first, last = sum(values[:tenth]) / tenth, sum(values[-tenth:]) / tenth
        print(f"{seed:>4} {len(values):>5} {first:>16.3f} {last:>8.3f} {before:>19.3f} "
              f"{after:>5.3f} {seconds:>11.0f}", flush=True)


if __name__ == "__main__":
    main()
