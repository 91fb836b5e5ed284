"""The agent endpoint against the built-in episode runner, through ``gspo fit`` as users run it.

Arms (``--arms``), each a run of ``--steps`` rollout steps of the lookup task on the tiny
lookup model, the Hugging Face engine, ``OMP_NUM_THREADS=--threads`` in both:

- ``builtin``: configs/episodes_lookup.yaml (the runner owns the loop);
- ``agent``: configs/agent_lookup.yaml (a plain ``openai`` agent calls the endpoint) with the
  agents in the trainer's process (``episodes.agent_processes=0``);
- ``agent-processes``: the recipe as shipped, its agents in 2 worker processes;
- ``builtin-slow`` / ``agent-slow``: the same with a 1 s tool action per episode
  (benchmarks/agent_tools.py) and a smaller batch (``--slow-prompts`` x 8 episodes): the
  built-in runner's environment steps one episode after another, the agents overlap.

Prints the median step time of each arm (the first step left out: it starts the engine) and
each agent arm's ratio to its built-in twin; ``--json`` keeps the numbers.

``--client``: what the ``openai`` client itself costs per call, apart from any model: 512
concurrent episodes of 3 calls against a stub server that answers after 20 ms, with httpx's
default connection pool, httpx's pool bounded to 32 connections, the openai package's aiohttp
transport with a pool of 1024 (the example agents' ``agent_client.py``), and a new client per
episode.

    python benchmarks/bench_agents.py --steps 6
    python benchmarks/bench_agents.py --client
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
SLOW_ENVIRONMENT = "--model.episodes.environment.class_path=agent_tools.SlowLookupEnvironment"
ARMS = {
    "builtin": ("configs/episodes_lookup.yaml", []),
    "agent": ("configs/agent_lookup.yaml", ["--model.episodes.agent_processes=0"]),
    "agent-processes": ("configs/agent_lookup.yaml", []),
    "builtin-slow": ("configs/episodes_lookup.yaml", [SLOW_ENVIRONMENT]),
    "agent-slow": ("configs/agent_lookup.yaml", ["--model.episodes.agent=agent_tools.slow_lookup_agent"]),
}
TWIN = {"agent": "builtin", "agent-processes": "builtin", "agent-slow": "builtin-slow"}


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def run_arm(arm: str, steps: int, threads: int, slow_prompts: int, workdir: Path) -> dict:
    config, overrides = ARMS[arm]
    if arm.endswith("-slow"):
        overrides = [*overrides, f"--data.rollout_batch_size={slow_prompts}", "--model.rollout.num_return_sequences_in_group=8",
                     f"--model.update.mini_batch_size={slow_prompts * 8}"]
    root = workdir / arm
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}"}
    command = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / config),
               f"--trainer.default_root_dir={root}", f"--trainer.max_steps={steps}", "--trainer.enable_progress_bar=false",
               "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=0", "--trainer.enable_checkpointing=false",
               "--model.export_on_fit_end=false", "--export=last", "--model.objective.old_logprobs=engine", *overrides]
    before = load()
    started = time.time()
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=workdir)
    if result.returncode:
        raise RuntimeError(f"{arm} failed:\n{result.stderr[-3000:]}")
    rows = [r for r in csv.DictReader(open(sorted(root.glob("csv/version_*/metrics.csv"))[-1])) if r.get("time/step")]
    step_s = [float(r["time/step"]) for r in rows][1:]
    out = {"arm": arm, "load_before": before, "wall_s": round(time.time() - started, 1),
           "step_s": round(statistics.median(step_s), 3),
           "generate_s": round(statistics.median(float(r["time/generate"]) for r in rows[1:]), 3),
           "episodes_per_step": int(rows[0].get("rollout/num_responses") or 0) or None}
    if arm.startswith("agent"):
        out["calls_per_step"] = round(statistics.mean(float(r["agent/calls"]) for r in rows[1:]), 1)
        out["gap_max"] = max(float(r["engine/logprob_abs_diff"]) for r in rows if r.get("engine/logprob_abs_diff"))
    return out


def client_cost(episodes: int = 512, calls: int = 3, delay_s: float = 0.02) -> dict:
    """ms per call of the openai client against a stub server (see the module's docstring)."""
    import asyncio
    import threading

    import openai
    from aiohttp import web

    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    reply = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "usage": {
        "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "3"}, "finish_reason": "stop", "logprobs": None}]}

    async def answer(request):
        await request.json()
        await asyncio.sleep(delay_s)  # the engine's batch
        return web.json_response(reply)

    loop, port = asyncio.new_event_loop(), []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port.append(site._server.sockets[0].getsockname()[1])
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    while not port:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port[0]}/v1"

    async def run(kind: str) -> float:
        shared = None
        if kind == "httpx, default pool":
            shared = openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0)
        elif kind == "httpx, pool of 32":
            limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
            shared = openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0,
                                        http_client=openai.DefaultAsyncHttpxClient(limits=limits))
        elif kind == "aiohttp, pool of 1024":
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
            shared = openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0,
                                        http_client=openai.DefaultAioHttpClient(limits=limits))

        async def episode(i: int) -> None:
            client = shared.with_options(api_key=f"k{i}") if shared else openai.AsyncOpenAI(
                base_url=url, api_key=f"k{i}", max_retries=0)
            for _ in range(calls):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "find c"}])
            if shared is None:
                await client.close()

        started = time.perf_counter()
        await asyncio.gather(*(episode(i) for i in range(episodes)))
        seconds = time.perf_counter() - started
        if shared is not None:
            await shared.close()  # its connections belong to this loop
        return round(seconds / (episodes * calls) * 1000, 2)

    results = {}
    for kind in ("httpx, default pool", "httpx, pool of 32", "aiohttp, pool of 1024", "new client per episode") * 2:  # alternating, twice
        results.setdefault(kind, []).append(asyncio.run(run(kind)))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default="builtin,agent,agent-processes,builtin-slow,agent-slow")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slow-prompts", type=int, default=4, help="prompts per step of the slow arms (8 episodes each)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--client", action="store_true", help="the openai client's own cost per call (see above)")
    args = parser.parse_args(argv)
    if args.client:
        print(f"load {load()}; ms per call, two alternating runs each:")
        for kind, values in client_cost().items():
            print(f"  {kind}: {values}")
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="gspo-bench-agents-"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    results = {}
    for arm in args.arms.split(","):
        results[arm] = run_arm(arm, args.steps + 1, args.threads, args.slow_prompts, workdir)
        print(json.dumps(results[arm]), flush=True)
    print(f"\ncommit {commit}, {args.steps} steps after the first, OMP_NUM_THREADS={args.threads}")
    print("| arm | step (s) | generate (s) | calls/step | vs built-in |")
    print("|---|---|---|---|---|")
    for arm, r in results.items():
        twin = results.get(TWIN.get(arm, ""))
        ratio = f"{r['step_s'] / twin['step_s']:.2f}x" if twin else ""
        print(f"| {arm} | {r['step_s']} | {r['generate_s']} | {r.get('calls_per_step', '')} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": commit, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
