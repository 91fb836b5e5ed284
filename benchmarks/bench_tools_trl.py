"""A multi-turn tool task: gspo-lightning against TRL's GRPOTrainer with its own tool loop, on one model folder.

    python benchmarks/bench_tools_trl.py                         # 20 steps, 2 runs each, 2 threads
    python benchmarks/bench_tools_trl.py --steps 8 --warmup 2 --repeats 1

The task is the lookup task (``configs/episodes_lookup_trl.yaml``): ``find c``, the answer is behind
the tool ``get(key)`` of ``LookupTable``, a class written for TRL's ``environment_factory``. The parent
exports ``builtin:tiny-lookup`` once (``gspo export-model``: random weights, seed 0), then alternates
fresh processes at the same ``OMP_NUM_THREADS``:

- ours: ``gspo fit --config configs/episodes_lookup_trl.yaml`` on that folder, ``--steps`` steps, no
  validation, no export, one optimizer step per rollout, a CSV logger; each step's ``time/step``,
  ``reward/mean``, ``episode/tool_calls`` and ``episode/turns`` are read from its metrics.csv;
- TRL: ``GRPOTrainer(environment_factory=LookupTable)`` on the same folder (``_trl_tools_child.py``:
  how the tokenizer object is set up there for the tiny model's ``get c`` calls, and what differs).

Both take the recipe's numbers: prompts x group per step, the episode budget
(``model.rollout.response_length`` = TRL's ``max_completion_length``), turns (``max_turns`` - 1 =
TRL's ``max_tool_calling_iterations``), tokens per turn, learning rate, reward weights. The table
gives the median step (after ``--warmup`` steps), ours / TRL, the mean reward and the answer reward
over the last ``--last`` steps, the tool calls and the assistant turns per episode, and whether
episodes really went past one turn. From random weights few episodes call the tool at first: in a
short run both sides stay near 0 reward.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import machine_busy_s  # noqa: E402
from bench_grid import median, run_logged, stamp, wait_for_quiet  # noqa: E402

CONFIG = HERE.parent / "configs" / "episodes_lookup_trl.yaml"


def recipe() -> dict:
    """The numbers of the recipe both sides run."""
    import yaml

    cfg = yaml.safe_load(CONFIG.read_text())
    model = cfg["model"]
    return {"response_length": model["rollout"]["response_length"], "max_turns": model["episodes"]["max_turns"],
            "max_turn_tokens": model["episodes"]["max_turn_tokens"], "lr": model["optimizer"]["init_args"]["lr"],
            "reward_weights": [float(r.get("weight", 1.0)) for r in model["rewards"]],
            "reward_names": [r["function"].rsplit(".", 1)[-1] for r in model["rewards"]],
            "prompts": cfg["data"]["rollout_batch_size"], "group": model["rollout"]["num_return_sequences_in_group"]}


def child_env(threads: int) -> dict:
    return dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(threads),
                HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TRL_EXPERIMENTAL_SILENCE="1",
                PYTHONPATH=os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]))


def run(command: list[str], out: Path, env: dict, timeout: float) -> tuple[float, float]:
    """``command`` in ``out`` (its output in child.log), killed past ``timeout``: the seconds it took, and the
    share of the cores other processes used meanwhile (the machine is shared: a busy neighbour slows a run)."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "child.log"
    start, busy = time.perf_counter(), machine_busy_s()
    code, usage = run_logged(command, out, env, log_path, timeout)
    wall = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"{command[0]} failed (exit {code}); log {log_path}:\n{log_path.read_text()[-4000:]}")
    others = max(0.0, machine_busy_s() - busy - usage.ru_utime - usage.ru_stime) / (wall * (os.cpu_count() or 1))
    return wall, others


def gspo_command(python: str) -> list[str]:
    gspo = shutil.which("gspo", path=str(Path(python).parent))
    return [gspo] if gspo else [python, "-m", "gspo_lightning.cli"]


def run_ours(args, model_dir: Path, out: Path, r: dict) -> dict:
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(out), "name": "csv"}}
    command = gspo_command(args.python) + [
        "fit", "--config", str(CONFIG),
        "--trainer.max_steps", str(args.steps),
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
        "--model.export_on_fit_end=false",
        f"--model.model_name_or_path={model_dir}",
        f"--trainer.logger={json.dumps(logger)}",
        f"--data.rollout_batch_size={args.prompts}",
        f"--model.rollout.num_return_sequences_in_group={args.group}",
        f"--model.update.mini_batch_size={args.prompts * args.group}",  # one optimizer step per rollout, as TRL's
        f"--seed_everything={args.seed}",
    ]
    wall, others = run(command, out, child_env(args.threads), args.timeout)
    metrics = sorted(out.glob("csv/version_*/metrics.csv"))
    if not metrics:
        raise RuntimeError(f"no metrics.csv under {out}/csv")
    by_step: dict[int, dict] = {}
    with open(metrics[-1]) as handle:
        for row in csv.DictReader(handle):
            if row.get("time/step"):
                by_step[int(float(row["step"]))] = row
    rows = [by_step[s] for s in sorted(by_step)]

    def column(name):
        return [float(row[name]) if row.get(name) else float("nan") for row in rows]

    answer = f"reward/{r['reward_names'][0]}"
    return {"step_s": column("time/step"), "reward": column("reward/mean"), "answer_reward": column(answer),
            "tool_calls": column("episode/tool_calls"), "turns": column("episode/turns"), "run_s": wall,
            "others_share": others}


def run_trl(args, model_dir: Path, out: Path, r: dict) -> dict:
    cfg = {"model_dir": str(model_dir), "out_dir": str(out), "prompts_per_step": args.prompts, "group_size": args.group,
           "response_length": r["response_length"], "max_turns": r["max_turns"], "max_turn_tokens": r["max_turn_tokens"],
           "lr": r["lr"], "reward_weights": r["reward_weights"], "steps": args.steps, "seed": args.seed,
           "threads": args.threads, "num_rows": max(2000, args.prompts * args.steps)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    wall, others = run([args.python, str(HERE / "_trl_tools_child.py"), str(out / "config.json")], out, child_env(args.threads),
               args.timeout)
    result = json.loads((out / "result.json").read_text())
    extra = result["extra"]
    return {"step_s": result["step_wall_s"], "reward": extra["reward_mean"], "answer_reward": extra["answer_reward"],
            "tool_calls": extra["tool_calls"], "turns": extra["turns"], "run_s": wall, "others_share": others,
            "setup_s": result["setup_s"], "step_contention": result["step_contention"],
            "versions": result["versions"]}


def mean(values) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else float("nan")


def summarize(runs: list[dict], warmup: int, last: int) -> dict:
    return {"runs": len(runs), "step_s": median(s for r in runs for s in r["step_s"][warmup:]),
            "reward_last": mean(v for r in runs for v in r["reward"][-last:]),
            "answer_last": mean(v for r in runs for v in r["answer_reward"][-last:]),
            "tool_calls": mean(v for r in runs for v in r["tool_calls"]),
            "tool_calls_last": mean(v for r in runs for v in r["tool_calls"][-last:]),
            "turns": mean(v for r in runs for v in r["turns"]),
            "run_s": median(r["run_s"] for r in runs), "others_share": median(r["others_share"] for r in runs)}


def table(s: dict) -> str:
    head = ["", "median s/step", "ours / TRL", "reward (last)", "answer reward (last)", "tool calls / episode (all, last)",
            "turns / episode", "multi-turn", "s / run", "others' share of the cores"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, key in (("ours (gspo fit)", "gspo"), ("TRL GRPOTrainer", "trl")):
        x = s[key]
        ratio = f"**{s['gspo']['step_s'] / s['trl']['step_s']:.2f}x**" if key == "gspo" else ""
        multi = "yes" if x["tool_calls"] > 0 and x["turns"] > 1 else "NO"
        lines.append("| " + " | ".join([name, f"{x['step_s']:.3f}", ratio, f"{x['reward_last']:.4f}", f"{x['answer_last']:.4f}",
                                         f"{x['tool_calls']:.3f}, {x['tool_calls_last']:.3f}", f"{x['turns']:.3f}", multi,
                                         f"{x['run_s']:.0f}", f"{x['others_share']:.0%}"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    r = recipe()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of a run left out of the step time (default 5)")
    parser.add_argument("--last", type=int, default=5, help="steps at the end of a run the rewards are averaged over")
    parser.add_argument("--repeats", type=int, default=2, help="runs per framework, alternated (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of both (default 2)")
    parser.add_argument("--prompts", type=int, default=r["prompts"], help=f"prompts per step (default {r['prompts']})")
    parser.add_argument("--group", type=int, default=r["group"], help=f"episodes per prompt (default {r['group']})")
    parser.add_argument("--seed", type=int, default=0, help="the exported model's weights and both trainers' seed")
    parser.add_argument("--frameworks", default="gspo,trl")
    parser.add_argument("--python", default=sys.executable, help="the environment both run in (ours: its gspo)")
    parser.add_argument("--workdir", default=None, help="keep the model, configs and logs here (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write every raw number here")
    parser.add_argument("--wait-quiet", type=float, default=10, help="seconds to wait for a quiet machine before a run")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")

    frameworks = [f for f in args.frameworks.split(",") if f]
    tmp = tempfile.TemporaryDirectory(prefix="bench_tools_trl_") if args.workdir is None else None
    workdir = Path(args.workdir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    report = {"stamp": stamp("bench_tools_trl.py"), "recipe": r, "args": vars(args), "runs": {f: [] for f in frameworks}}
    try:
        model_dir = workdir / "model"
        if not (model_dir / "config.json").is_file():
            subprocess.run(gspo_command(args.python) + ["export-model", "--model", "builtin:tiny-lookup", "--out",
                                                        str(model_dir), "--seed", str(args.seed)],
                           check=True, env=child_env(args.threads), stdout=subprocess.DEVNULL)
        print(f"{args.prompts} prompts x {args.group} episodes per step, episodes of up to {r['max_turns']} turns of "
              f"{r['max_turn_tokens']} tokens in {r['response_length']} tokens; {args.steps} steps per run "
              f"({args.warmup} warm-up), {args.threads} threads; model {model_dir}", flush=True)
        for rep in range(args.repeats):
            for framework in frameworks:
                if args.wait_quiet > 0:
                    wait_for_quiet(args.wait_quiet)
                out = workdir / f"{framework}_{rep}"
                res = (run_ours if framework == "gspo" else run_trl)(args, model_dir, out, r)
                report["runs"][framework].append(res)
                print(f"[{framework} run {rep + 1}] median step {median(res['step_s'][args.warmup:]):.3f}s, "
                      f"reward (last {args.last}) {mean(res['reward'][-args.last:]):.4f}, "
                      f"tool calls/episode {mean(res['tool_calls']):.3f}, turns/episode {mean(res['turns']):.3f}, "
                      f"run {res['run_s']:.0f}s, others used {res['others_share']:.0%} of the cores", flush=True)
        summary = {f: summarize(report["runs"][f], args.warmup, args.last) for f in frameworks}
        report["summary"] = summary
        st = report["stamp"]
        print(f"\n`{st['command']}` at commit `{st['commit']}`"
              + (f" (changed: {', '.join(st['dirty_tracked_files'])})" if st["dirty_tracked_files"] else "")
              + f", {st['date']}, {st['cpus']} x {st['cpu']}")
        if "gspo" in summary and "trl" in summary:
            print(table(summary))
        versions = next((r_["versions"] for r_ in report["runs"].get("trl", [])), {})
        if versions:
            print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
