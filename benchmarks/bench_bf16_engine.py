"""The rollout engine in bfloat16 on CPU against float32, through ``gspo fit`` as users run it.

Two arms on the same config, alternating: the Hugging Face engine sampling from the float32
policy itself (the default), and ``HFCopyEngine`` sampling from a bfloat16 copy (weights and KV
cache in bf16; the trainer stays float32 and recomputes the old log-probs, the default). The CPU's
bf16 units (``avx512_bf16``, ``amx_bf16`` in /proc/cpuinfo) are printed first: without them
PyTorch emulates bf16 and it is slower than float32.

    python benchmarks/bench_bf16_engine.py [--config configs/quickstart.yaml] [--steps 150] [--repeats 1]
    python benchmarks/bench_bf16_engine.py --config configs/smollm2_cpu.yaml --steps 3 --no-eval

Prints per arm: the median step time and generation time (the first 2 steps are warm-up), the
held-out accuracy at each evaluation, the largest engine-vs-trainer log-prob gap and the mean
clip fraction: what bf16 sampling does to speed and to learning.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "float32 (HFEngine)": [],
    "bfloat16 (HFCopyEngine)": ["--model.engine.class_path=gspo_lightning.rollout.HFCopyEngine",
                                "--model.engine.init_args.dtype=bfloat16"],
}


def bf16_units() -> list[str]:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    return sorted({f for f in flags if f in ("avx512_bf16", "amx_bf16", "amx_tile")})


def run_arm(folder: Path, overrides: list[str], args) -> dict:
    command = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / args.config),
               f"--trainer.max_steps={args.steps}", f"--trainer.default_root_dir={folder}",
               "--trainer.enable_progress_bar=false", "--model.export_on_fit_end=false", *overrides]
    if args.no_eval:
        command += ["--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [r for r in csv.DictReader(open(next(folder.rglob("metrics.csv")))) if r.get("reward/mean")]
    timed = rows[2:] or rows
    evals = [json.loads(line) for f in folder.rglob("eval_results.jsonl") for line in f.read_text().splitlines()]
    return {
        "step": statistics.median(float(r["time/step"]) for r in timed),
        "generate": statistics.median(float(r["time/generate"]) for r in timed),
        "accuracy": [round(e["val/accuracy"], 3) for e in evals],
        "gap": max(float(r["engine/logprob_abs_diff"]) for r in rows),
        "clip": statistics.mean(float(r["loss/clip_frac"]) for r in rows),
        "reward_last": statistics.mean(float(r["reward/mean"]) for r in rows[-max(1, len(rows) // 10):]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-eval", action="store_true", help="time steps only (no held-out evaluations)")
    args = parser.parse_args(argv)
    print(f"{args.config}, {args.steps} steps, OMP_NUM_THREADS={args.threads}; CPU bf16 units: "
          f"{', '.join(bf16_units()) or 'none'}")
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for index, (arm, overrides) in enumerate(ARMS.items()):
                results[arm].append(run_arm(Path(tmp) / f"{index}_{repeat}", overrides, args))
    print(f"{'arm':<26}{'step s':>9}{'generate s':>12}{'gap max':>10}{'clip frac':>11}{'last reward':>13}  held-out accuracy")
    for arm, runs in results.items():
        step = statistics.median(r["step"] for r in runs)
        generate = statistics.median(r["generate"] for r in runs)
        print(f"{arm:<26}{step:>9.3f}{generate:>12.3f}{max(r['gap'] for r in runs):>10.1e}"
              f"{statistics.mean(r['clip'] for r in runs):>11.4f}{statistics.mean(r['reward_last'] for r in runs):>13.3f}"
              f"  {' | '.join(' '.join(map(str, r['accuracy'])) for r in runs)}")
    fp32, bf16 = (statistics.median(r["step"] for r in runs) for runs in results.values())
    print(f"step time, bf16 engine / fp32 engine: {bf16 / fp32:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
