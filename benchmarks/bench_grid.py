"""gspo-lightning (through ``gspo fit``) against TRL's GRPOTrainer on a grid of model shapes.

    python benchmarks/bench_grid.py                       # the whole grid
    python benchmarks/bench_grid.py --vocab 100 --size 0.6M --length 16 --repeats 1
    python benchmarks/bench_grid.py --precision fp32 --precision bf16   # each cell at both, TRL at the same

Cells: vocabulary {100, 2k, 32k} x response length {16, 32, 128} x model size {0.6M, 25M}
decoder parameters. For each cell the parent builds one model folder (fixed seed) and one
prompt file, then alternates fresh processes: ``gspo fit --config cell.yaml`` (a CSV
logger on, as users run it, plus a measuring callback, ``_probe.py``) and a TRL
``GRPOTrainer`` set up for the same GSPO work (``_trl_child.py``). It prints per cell the
median step time, the phases, the peak RSS, the ratios ours / TRL, and the fp32 FLOP limit
of the step: its model FLOPs (``_common.step_flops``) over the best fp32 matmul rate
measured on this machine. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import itertools
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
sys.path.insert(0, str(HERE))

from _common import MODEL_SIZES, VOCABS, BenchConfig, build_bench_model, machine_busy_s, matmul_rate, step_flops, write_prompts  # noqa: E402

LENGTHS = (16, 32, 128)
PROMPTS_PER_STEP, GROUP, PROMPT_TOKENS = 8, 8, 48  # 64 completions per step, prompts of <= 48 tokens
# (steps, warm-up steps) per run; the warm-up covers the start-up trial of our thread rule (one
# untimed step, then >= 3 steps and >= 0.3 s on each count: up to 10 steps of the 0.07M model)
RUN_STEPS = {"0.07M": (20, 10), "0.6M": (16, 7), "25M": (4, 1)}
# Cells left out by default: each would add ~8-15 minutes on 2 cores (estimated from the measured
# growth of TRL's step with length: docs/benchmarks.md). --all runs them anyway.
SKIP = {("32k", "25M", 128), ("2k", "25M", 128), ("100", "25M", 128)}
PHASES = ["generate", "score", "logprobs", "train", "weight_sync"]


def default_source() -> str:
    from gspo_lightning.data.datasets import BUILTIN_FILES

    return str(BUILTIN_FILES["gsm8k"])


def gspo_config(cell: str, model_dir: Path, prompts: Path, out_dir: Path, length: int, steps: int, seed: int,
                profile: bool, warmup: int, precision: str = "fp32") -> dict:
    """A ``gspo fit`` config for the cell: the same work as the TRL child (``precision`` bf16: Lightning's
    bf16-mixed, autocast to bfloat16 around the step, as TRL's ``bf16=True`` through accelerate)."""
    return {
        "seed_everything": seed,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": steps, "default_root_dir": str(out_dir),
            "precision": "bf16-mixed" if precision == "bf16" else "32-true",
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(out_dir), "name": "csv"}}],
            "callbacks": [{"class_path": "_probe.StepProbe", "init_args": {
                "out_dir": str(out_dir), "cell": cell, "warmup": warmup,
                "cprofile": str(out_dir / "gspo_profile.prof") if profile else ""}}],
        },
        "model": {
            "model_name_or_path": str(model_dir),
            "rewards": [{"function": "_common.bench_reward"}],
            "num_return_sequences_in_group": GROUP,
            "response_length": length,
            "temperature": 1.0,
            "adv_estimator": "grpo",
            "importance_sampling": "seq",
            "clip_low": 3e-4, "clip_high": 4e-4,
            "loss_agg_mode": "seq-mean-token-mean",  # TRL loss_type="grpo"
            "num_mini_batches": 1, "ppo_epochs": 1,  # one optimizer step per rollout, as the TRL child
            "micro_batch_size": PROMPTS_PER_STEP * GROUP,  # and one forward (the default caps it at 8192 tokens)
            "max_grad_norm": 1.0,
            "rollout_seed": seed,
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-6, "weight_decay": 0.0}},
        },
        "data": {"path": str(prompts), "prompt_field": "prompt", "rollout_batch_size": PROMPTS_PER_STEP,
                 "prompt_length": 64, "shuffle": False, "val_size": 0},
    }


def run_logged(command: list[str], cwd: Path, env: dict, log_path: Path, timeout: float):
    """``command`` in ``cwd``, its output in ``log_path``, killed past ``timeout`` seconds: its exit code
    and its ``rusage`` (its own CPU time and peak RSS, from ``wait4``)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
    return os.waitstatus_to_exitcode(status), usage


def run_child(framework: str, cfg: BenchConfig, timeout: float, gspo_cfg: dict | None, python: str = sys.executable,
              our_threads: int = 0) -> dict:
    """One measurement in a fresh process run by ``python`` (ours: the ``gspo`` beside it); its result.json
    plus the process's ru_maxrss."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(cfg.threads),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if framework == "gspo" and not our_threads:
        env.pop("OMP_NUM_THREADS")  # as users run it: the `gspo` command chooses (run/cpu_threads.py)
    elif framework == "gspo":
        env["OMP_NUM_THREADS"] = str(our_threads)
    if framework == "gspo":
        import yaml

        (out / "config.yaml").write_text(yaml.safe_dump(gspo_cfg, sort_keys=False))
        # the `gspo` command of that environment (the same entry point as `python -m gspo_lightning.cli`)
        gspo = shutil.which("gspo", path=str(Path(python).parent))
        command = [gspo] if gspo else [python, "-m", "gspo_lightning.cli"]
        command += ["fit", "--config", str(out / "config.yaml")]
    else:
        cfg.dump(out / "config.json")
        command = [python, str(HERE / "_trl_child.py"), str(out / "config.json")]
    log_path = out / "child.log"
    start = time.perf_counter()
    code, usage = run_logged(command, out, env, log_path, timeout)
    result_path = out / "result.json"
    if code != 0 or not result_path.is_file():
        raise RuntimeError(f"{framework} run failed (exit {code}); log {log_path}:\n{log_path.read_text()[-4000:]}")
    result = json.loads(result_path.read_text())
    result["wait4_maxrss_mib"] = usage.ru_maxrss / 1024
    result["child_wall_s"] = time.perf_counter() - start
    return result


def median(values) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def summarize(runs: list[dict], warmup: int, max_contention: float, use_clean: bool) -> dict:
    measured = [(r, i) for r in runs for i in range(warmup, len(r["step_wall_s"]))]
    clean = [(r, i) for r, i in measured if r["step_contention"][i] < max_contention]
    use = clean if use_clean else measured
    out = {"runs": len(runs), "measured_steps": len(measured), "clean_steps": len(clean), "clean": use is clean,
           "step_s": median(r["step_wall_s"][i] for r, i in use),
           "step_s_all": median(r["step_wall_s"][i] for r, i in measured),
           "step_s_min": min(r["step_wall_s"][i] for r, i in measured)}
    for phase in PHASES:
        out[phase] = median(r["phases"][phase][i] for r, i in use if phase in r["phases"])
    out["other"] = median(r["step_wall_s"][i] - sum(r["phases"][p][i] for p in PHASES if p in r["phases"]) for r, i in use)
    out["response_length_mean"] = median(r["response_length_mean"][i] for r, i in measured)
    out["peak_rss_mib"] = median(r["process_peak_rss_mib"] for r in runs)
    out["train_delta_rss_mib"] = median(r["train_peak_rss_mib"] - r["baseline_rss_mib"] for r in runs)
    return out


def wait_for_quiet(max_wait: float, threshold: float = 0.15) -> float:
    ncpu = os.cpu_count() or 1
    start = time.perf_counter()
    while True:
        before = machine_busy_s()
        time.sleep(1.0)
        share = (machine_busy_s() - before) / ncpu
        if share < threshold or time.perf_counter() - start > max_wait:
            return share


COLUMNS = [  # (header, function of the cell's record) for the markdown / text table
    ("vocab", lambda c: c["vocab"]),
    ("model (total params)", lambda c: f"{c['size']} ({c['params_m']:.1f}M)"),
    ("resp. tokens", lambda c: str(c["length"])),
    ("precision", lambda c: c.get("precision", "fp32")),
    ("ours s/step", lambda c: f"{c['gspo']['step_s']:.3f}"),
    ("TRL s/step", lambda c: f"{c['trl']['step_s']:.3f}"),
    ("ours / TRL", lambda c: f"**{c['gspo']['step_s'] / c['trl']['step_s']:.2f}x**"),
    ("ours gen / train / other", lambda c: "{:.3f} / {:.3f} / {:.3f}".format(c["gspo"]["generate"], c["gspo"]["train"], c["gspo"]["other"])),
    ("TRL gen / train / other", lambda c: "{:.3f} / {:.3f} / {:.3f}".format(c["trl"]["generate"], c["trl"]["train"], c["trl"]["other"])),
    ("peak RSS MiB ours / TRL", lambda c: f"{c['gspo']['peak_rss_mib']:.0f} / {c['trl']['peak_rss_mib']:.0f} "
                                          f"({c['gspo']['peak_rss_mib'] / c['trl']['peak_rss_mib']:.2f}x)"),
    ("FLOP limit s", lambda c: f"{c['limit_s']:.3f}"),
    ("ours / limit", lambda c: f"{c['gspo']['step_s'] / c['limit_s']:.1f}x"),
]


def cpu_name() -> str:
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor()


def stamp(script: str = "bench_grid.py") -> dict:
    """Which code made the numbers, and on what machine."""

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True, check=True).stdout.rstrip()
        except (OSError, subprocess.CalledProcessError):
            return None

    dirty = git("status", "--porcelain", "--untracked-files=no") or ""
    return {"commit": git("rev-parse", "HEAD"), "dirty_tracked_files": sorted(line[3:] for line in dirty.splitlines()),
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpu": cpu_name(), "cpus": os.cpu_count(),
            "command": " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]])}


def markdown(report: dict) -> str:
    """The table with the stamp above it, as docs/benchmarks.md quotes it."""
    st = report["stamp"]
    versions = ", ".join(f"{k} {v}" for k, v in report.get("versions", {}).items())
    head = [f"`{st['command']}` at commit `{st['commit']}`" + (f" (changed: {', '.join(st['dirty_tracked_files'])})"
                                                               if st["dirty_tracked_files"] else "") + f", {st['date']}.",
            f"{st['cpus']} x {st['cpu']}, {report['threads']} threads, best fp32 matmul rate "
            f"{report['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s; {versions}.", ""]
    tail = ["", f"Skipped (too long on this machine; `--all` runs them): {', '.join(report['skipped'])}."] if report["skipped"] else []
    return "\n".join(head) + "\n" + table(report["cells"]) + "\n" + "\n".join(tail) + "\n"


def table(cells: list[dict]) -> str:
    done = [c for c in cells if "gspo" in c and "trl" in c]
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(f(c) for _, f in COLUMNS) + " |" for c in done]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", action="append", choices=list(VOCABS), help="repeatable; default: all")
    parser.add_argument("--size", action="append", choices=list(MODEL_SIZES), help="repeatable; default: all")
    parser.add_argument("--length", action="append", type=int, help=f"response tokens, repeatable; default: {LENGTHS}")
    parser.add_argument("--all", action="store_true", help="also the cells skipped by default (SKIP)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per framework and cell, alternated (default 2)")
    parser.add_argument("--steps", type=int, help="steps per run (default: per model size, RUN_STEPS)")
    parser.add_argument("--warmup", type=int, help="first steps of a run left out (default: per model size)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the TRL child (torch's default: all cores)")
    parser.add_argument("--our-threads", type=int, default=0,
                        help="OMP_NUM_THREADS of our run (default 0: unset, the `gspo` command chooses: run/cpu_threads.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", action="append", choices=["fp32", "bf16"],
                        help="repeatable: each cell at each (default fp32); bf16: autocast to bfloat16 on both sides "
                             "(TRL bf16=True, ours precision bf16-mixed), the weights and optimizer in fp32")
    parser.add_argument("--frameworks", default="gspo,trl")
    parser.add_argument("--source", default=None, help="GSM8K jsonl for the prompts (default: the package's subset)")
    parser.add_argument("--workdir", default=None, help="keep models, configs, logs here (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write every raw number here")
    parser.add_argument("--markdown", default=None, help="write the table here")
    parser.add_argument("--profile", action="store_true", help="cProfile our measured steps (gspo_profile.prof per run)")
    parser.add_argument("--max-contention", type=float, default=0.1,
                        help="a step is clean when other processes used less than this share of the cores")
    parser.add_argument("--wait-quiet", type=float, default=20, help="seconds to wait for a quiet machine before a run")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = parser.parse_args(argv)

    vocabs, sizes, lengths = args.vocab or list(VOCABS), args.size or list(MODEL_SIZES), args.length or list(LENGTHS)
    frameworks = [f for f in args.frameworks.split(",") if f]
    tmp = tempfile.TemporaryDirectory(prefix="bench_grid_") if args.workdir is None else None
    workdir = Path(args.workdir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    source = args.source or default_source()
    rate = matmul_rate(args.threads)
    print(f"fp32 matmul rate at {args.threads} threads: {rate / 1e9:.1f} GFLOP/s (re-measured before each cell, "
          f"the best is kept)", flush=True)
    report = {"stamp": stamp(), "argv": sys.argv[1:], "matmul_flops_per_s": rate, "threads": args.threads, "cells": [], "skipped": []}
    shapes, prompt_stats = {}, {}
    try:
        for size, vocab, length, precision in itertools.product(sizes, vocabs, lengths, args.precision or ["fp32"]):
            cell_name = f"{vocab}-{size}-{length}" + ("" if precision == "fp32" else f"-{precision}")
            if (vocab, size, length) in SKIP and not args.all:
                print(f"[{cell_name}] skipped (too long on this machine; --all runs it)", flush=True)
                report["skipped"].append(cell_name)
                continue
            steps, warmup = RUN_STEPS[size]
            steps, warmup = args.steps or steps, warmup if args.warmup is None else args.warmup
            model_dir = workdir / "models" / f"{vocab}-{size}"
            if (vocab, size) not in shapes:
                shapes[(vocab, size)] = build_bench_model(vocab, size, model_dir, args.seed)
            shape = shapes[(vocab, size)]
            prompts = workdir / "models" / f"prompts-{vocab}.jsonl"
            if vocab not in prompt_stats:
                prompt_stats[vocab] = write_prompts(shape["tokenizer"], source, prompts, PROMPT_TOKENS, PROMPTS_PER_STEP * 12)
            stats = prompt_stats[vocab]
            flops = step_flops(shape, PROMPTS_PER_STEP, GROUP, stats["prompt_tokens_mean"], length)
            # the best rate seen so far: a busy neighbour only ever lowers a measurement
            rate = max(rate, matmul_rate(args.threads))
            report["matmul_flops_per_s"] = rate
            cell = {"cell": cell_name, "vocab": vocab, "size": size, "length": length, "precision": precision,
                    "steps": steps, "warmup": warmup,
                    "params_m": shape["params_m"], "decoder_params_m": shape["decoder_params_m"],
                    "vocab_size": shape["vocab_size"], "prompt_tokens_mean": stats["prompt_tokens_mean"],
                    "flops": flops, "limit_s": flops["total"] / rate, "runs": {f: [] for f in frameworks}}
            for rep in range(args.repeats):
                for framework in frameworks:
                    out_dir = workdir / cell_name / f"{framework}_{rep}"
                    cfg = BenchConfig(size=cell_name, model_dir=str(model_dir), prompts_file=str(prompts),
                                      prompts_per_step=PROMPTS_PER_STEP, group_size=GROUP, response_length=length,
                                      steps=steps, warmup=warmup, threads=args.threads, seed=args.seed, out_dir=str(out_dir),
                                      precision=precision)
                    gspo_cfg = gspo_config(cell_name, model_dir, prompts, out_dir, length, steps, args.seed,
                                           args.profile, warmup, precision) if framework == "gspo" else None
                    if args.wait_quiet > 0:
                        wait_for_quiet(args.wait_quiet)
                    result = run_child(framework, cfg, args.timeout, gspo_cfg, our_threads=args.our_threads)
                    cell["runs"][framework].append(result)
                    print(f"[{cell_name}] {framework} run {rep + 1}: median step "
                          f"{median(result['step_wall_s'][warmup:]):.3f}s, peak RSS {result['process_peak_rss_mib']:.0f} MiB, "
                          f"others used {median(result['step_contention'][warmup:]):.0%} of the cores, "
                          f"run {result['child_wall_s']:.0f}s", flush=True)
            use_clean = all(sum(r["step_contention"][i] < args.max_contention
                                for r in cell["runs"][f] for i in range(warmup, len(r["step_wall_s"]))) >= 3
                            for f in frameworks)
            for f in frameworks:
                cell[f] = summarize(cell["runs"][f], warmup, args.max_contention, use_clean)
            report["cells"].append(cell)
            for c in report["cells"]:  # every cell's limit against the best rate
                c["limit_s"] = c["flops"]["total"] / rate
            if "gspo" in cell and "trl" in cell:
                print("\n" + table([cell]) + "\n", flush=True)
        versions = next((c["runs"][f][0]["versions"] for c in report["cells"] for f in frameworks if c["runs"][f]), {})
        report["versions"] = versions
        print(f"best fp32 matmul rate at {args.threads} threads: {rate / 1e9:.1f} GFLOP/s")
        print(table(report["cells"]))
        print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
        if report["skipped"]:
            print("skipped: " + ", ".join(report["skipped"]))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        if args.markdown:
            Path(args.markdown).write_text(markdown(report))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
