"""An LLM judge scored group by group while the rest generate, against after the generation.

Through ``gspo fit`` as users run it: the quickstart's policy with an LLM judge as its reward
(``gspo_lightning.rewards.LLMJudge``), ``--model.rollout.score_while_generating=true`` against
``false``, runs alternating, in one invocation. The judge is a local OpenAI-compatible server
(``_latency_judge.py``) that answers each request after ``--latency-s`` (a hosted judge's round
trip, which a tiny local model does not have) with the successor judge's verdict; the judge's
``max_concurrency`` bounds it as a rate limit would. Responses end at different tokens (random
weights, ``--response-length`` up to 64), so some groups end while others still generate.

    python benchmarks/bench_judge_overlap.py [--steps 12] [--repeats 2] [--latency-s 0.05] [--concurrency 16]
    python benchmarks/bench_judge_overlap.py --model builtin:smollm2-135m-instruct --prompts 8 --latency-s 0.5 --concurrency 8

Prints each arm's median step time, generation time and scoring time (the time after the
generation until every score is in), and the ratio.
"""

from __future__ import annotations

import argparse
import csv
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

CONFIG = """seed_everything: 3
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {steps}
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_checkpointing: false
  default_root_dir: {root}
model:
  model_name_or_path: {model}
  export_on_fit_end: false
  rewards:
    - function: gspo_lightning.rewards.LLMJudge
      factory: true
      name: judge
      kwargs: {{base_url: "{url}", model: judge, api_key_env: BENCH_JUDGE_KEY, prompt: "{{prompt}} answer {{completion}}",
               max_concurrency: {concurrency}, timeout_s: 30}}
  rollout:
    num_return_sequences_in_group: 8
    response_length: {length}
    score_while_generating: {stream}
  update:
    mini_batch_size: 32
data:
  path: builtin:successor
  rollout_batch_size: {prompts}
  prompt_length: 8
"""


def run_arm(workdir: Path, stream: bool, index: int, url: str, key: str, args) -> dict[str, float]:
    root = workdir / f"{'stream' if stream else 'after'}_{index}"
    config = workdir / f"{root.name}.yaml"
    config.write_text(CONFIG.format(steps=args.steps, root=root, url=url, concurrency=args.concurrency,
                                    length=args.response_length, stream=str(stream).lower(), model=args.model,
                                    prompts=args.prompts))
    env = {**os.environ, "BENCH_JUDGE_KEY": key, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run([sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(config)], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    rows = [r for r in csv.DictReader(open(next(root.rglob("metrics.csv")))) if r.get("reward/judge")][2:]  # warm-up
    return {key: statistics.median(float(r[column]) for r in rows)
            for key, column in (("step", "time/step"), ("generate", "time/generate"), ("score", "time/score"))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--latency-s", type=float, default=0.05)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="builtin:tiny-successor",
                        help="the policy (builtin:smollm2-135m-instruct: a real model, whose answers end where it decides)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (8 responses each)")
    args = parser.parse_args(argv)
    key = secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        port_file = workdir / "port"
        server = subprocess.Popen([sys.executable, str(HERE / "_latency_judge.py"), "--latency-s", str(args.latency_s),
                                   "--port-file", str(port_file)], env={**os.environ, "BENCH_JUDGE_KEY": key})
        try:
            for _ in range(100):
                if port_file.exists() and port_file.read_text():
                    break
                time.sleep(0.1)
            url = f"http://127.0.0.1:{port_file.read_text().strip()}/v1"
            results: dict[bool, list[dict]] = {True: [], False: []}
            for index in range(args.repeats):
                for stream in (True, False):
                    results[stream].append(run_arm(workdir, stream, index, url, key, args))
        finally:
            server.terminate()
            server.wait(10)
    print(f"{args.model}; judge latency {args.latency_s} s per request, max_concurrency {args.concurrency}, {args.prompts} prompts x 8 "
          f"responses of up to {args.response_length} tokens, {args.steps} steps ({args.steps - 2} timed), "
          f"{args.repeats} runs per arm alternating, OMP_NUM_THREADS={args.threads}")
    print(f"{'arm':<28}{'step s':>10}{'generate s':>12}{'score s':>10}")
    medians = {}
    for stream, name in ((False, "score after generation"), (True, "score while generating")):
        medians[stream] = {k: statistics.median(r[k] for r in results[stream]) for k in ("step", "generate", "score")}
        m = medians[stream]
        print(f"{name:<28}{m['step']:>10.3f}{m['generate']:>12.3f}{m['score']:>10.3f}")
    print(f"step time, while / after: {medians[True]['step'] / medians[False]['step']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
