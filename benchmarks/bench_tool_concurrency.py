"""Tool calls side by side: a lookup-sized step with a tool that takes 1 s.

Through ``gspo fit`` as users run it. First the lookup recipe (configs/episodes_lookup_trl.yaml)
trains a tiny policy that calls its tool in nearly every episode (150 steps, ~1-2 min); then that
policy runs the same recipe for a few steps with the tool replaced by one that sleeps
``--sleep-s`` (``benchmarks/_slow_tools.py``), for each ``model.episodes.max_concurrent_tools``
given. One step is 16 prompts x 32 episodes, so up to 512 calls per turn: one after another they
would cost 512 s; the generation time of a step shows what they cost side by side.

    python benchmarks/bench_tool_concurrency.py [--limits 16 256 512] [--steps 3] [--sleep-s 1]

Prints, per limit, the median step's generation time (engine and tools), its tool calls and what
they would have cost one after another.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "episodes_lookup_trl.yaml"


def gspo_fit(*overrides: str, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(CONFIG),
                    "--trainer.enable_progress_bar=false", *overrides], check=True, env=env, stdout=subprocess.DEVNULL)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", type=int, nargs="+", default=[16, 256, 512])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sleep-s", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "BENCH_TOOL_SLEEP_S": str(args.sleep_s),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    recipe = yaml.safe_load(CONFIG.read_text())
    episodes = recipe["data"]["rollout_batch_size"] * recipe["model"]["rollout"]["num_return_sequences_in_group"]
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        gspo_fit("--trainer.max_steps=150", f"--trainer.default_root_dir={work / 'train'}", env=env)
        policy = next((work / "train").rglob("hf_model/config.json")).parent
        print(f"lookup policy trained (150 steps); {episodes} episodes per step, tool sleep {args.sleep_s} s, {args.steps} steps per limit, "
              f"OMP_NUM_THREADS={args.threads}")
        print(f"{'max_concurrent_tools':>22}{'generate s':>12}{'tool calls':>12}{'one after another s':>22}")
        for limit in args.limits:
            root = work / f"limit_{limit}"
            gspo_fit(f"--model.model_name_or_path={policy}", f"--trainer.max_steps={args.steps}",
                     f"--trainer.default_root_dir={root}", "--trainer.limit_val_batches=0",
                     "--trainer.num_sanity_val_steps=0", "--model.export_on_fit_end=false",
                     "--model.episodes.environment.init_args.factory=benchmarks._slow_tools.SlowLookupTable",
                     f"--model.episodes.max_concurrent_tools={limit}", env=env)
            rows = [r for r in csv.DictReader(open(next(root.rglob("metrics.csv")))) if r.get("reward/mean")]
            generate = statistics.median(float(r["time/generate"]) for r in rows)
            calls = statistics.median(float(r["episode/tool_calls"]) * episodes for r in rows)
            print(f"{limit:>22}{generate:>12.2f}{calls:>12.0f}{calls * args.sleep_s:>22.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
