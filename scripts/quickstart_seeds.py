"""Run the CPU quickstart for several seeds and report the reward of the first and last
tenth of the rollout steps (the numbers in docs/quickstart.md).

    python scripts/quickstart_seeds.py --seeds 0 1 2
"""

import argparse
import csv
import subprocess
import sys
import time
from pathlib import Path

import yaml


def rewards(folder: Path) -> list[float]:
    metrics = sorted(folder.glob("csv/version_*/metrics.csv"))[-1]
    with open(metrics) as handle:
        return [float(row["reward/mean"]) for row in csv.DictReader(handle) if row.get("reward/mean")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--out", default="runs/quickstart_seeds")
    args = parser.parse_args()
    print(f"{'seed':>4} {'steps':>5} {'first 10%':>9} {'last 10%':>9} {'seconds':>8}")
    for seed in args.seeds:
        folder = Path(args.out) / f"seed{seed}"
        start = time.time()
        config = yaml.safe_load(Path(args.config).read_text())
        config["seed_everything"] = seed
        config["trainer"].update(default_root_dir=str(folder), enable_progress_bar=False)
        for logger in config["trainer"]["logger"]:
            logger["init_args"]["save_dir"] = str(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        subprocess.run([sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(folder / "config.yaml")],
                       check=True, capture_output=True)
        values = rewards(folder)
        tenth = max(1, len(values) // 10)
        first, last = sum(values[:tenth]) / tenth, sum(values[-tenth:]) / tenth
        print(f"{seed:>4} {len(values):>5} {first:>9.3f} {last:>9.3f} {time.time() - start:>8.1f}")


if __name__ == "__main__":
    main()
