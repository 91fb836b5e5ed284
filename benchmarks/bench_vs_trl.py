"""gspo-lightning against TRL's GRPOTrainer on the same GSPO work, in one command.

    python benchmarks/bench_vs_trl.py --size tiny --size small

For each size the parent builds one model and tokenizer with a fixed seed, saves them to a
temporary folder, writes the prompts both frameworks read, then runs each framework in a
fresh child process, alternating (gspo, trl, gspo, trl, ...), so that every measurement
has a clean process and a clean peak RSS and a slow spell on a shared machine hits both.
It prints medians of the per-step wall time after warm-up, the time per phase, the peak
memory, and the ratios ours / TRL. TRL is a benchmark-only dependency (``pip install
-e ".[bench]"``). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import BenchConfig, write_prompts  # noqa: E402

# The work of one optimizer step; both frameworks get exactly these numbers.
SIZES = {
    # 0.2M parameters, 2000-token BPE vocabulary: overheads dominate
    "tiny": dict(model="builtin:tiny-gsm8k", prompts_per_step=8, group_size=8, response_length=32,
                 max_prompt_tokens=64, steps=8, warmup=2),
    # 11M parameters, 32k vocabulary (74% of the weights are the embedding / tied head), longer
    # responses: the vocabulary projection dominates compute and memory
    "small": dict(model="builtin:small-32k", prompts_per_step=4, group_size=8, response_length=128,
                  max_prompt_tokens=64, steps=5, warmup=2),
}
PHASES = ["generate", "score", "logprobs", "train", "weight_sync"]
CHILDREN = {"gspo": HERE / "_gspo_child.py", "trl": HERE / "_trl_child.py"}


def default_gsm8k() -> str:
    from gspo_lightning.tasks.tiny import shared_data_dir

    return str(shared_data_dir() / "gsm8k" / "train.jsonl")


def build_model(name: str, folder: Path, seed: int) -> dict:
    """Build the builtin model once with a fixed seed; both frameworks load this folder."""
    import torch
    from transformers import PreTrainedTokenizerFast

    from gspo_lightning.tasks import save_tiny

    torch.manual_seed(seed)
    save_tiny(name, folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    text = "Natalia sold 48 clips in April."
    if tokenizer.decode(tokenizer(text)["input_ids"]) != text:
        raise RuntimeError(f"tokenizer of {folder} does not round-trip {text!r}")
    config = json.loads((folder / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        params = sum(_prod(weights.get_slice(key).get_shape()) for key in weights.keys())
    return {"tokenizer": tokenizer, "vocab_size": config["vocab_size"], "params_m": params / 1e6}


def run_child(framework: str, cfg: BenchConfig, timeout: float) -> dict:
    """Run one measurement; returns the child's result.json plus its ru_maxrss from wait4."""
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    config_path = Path(cfg.out_dir) / "config.json"
    cfg.dump(config_path)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS=str(cfg.threads), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    log_path = Path(cfg.out_dir) / "child.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(CHILDREN[framework]), str(config_path)],
                                cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
    result_path = Path(cfg.out_dir) / "result.json"
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"{framework} child failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["wait4_maxrss_mib"] = usage.ru_maxrss / 1024
    result["child_wall_s"] = time.perf_counter() - start
    return result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def clean_steps(runs: list[dict], warmup: int, max_contention: float) -> list[tuple[dict, int]]:
    """Measured steps during which other processes used less than ``max_contention`` of the cores."""
    return [(r, i) for r in runs for i in range(warmup, len(r["step_wall_s"]))
            if r["step_contention"][i] < max_contention]


def summarize(runs: list[dict], warmup: int, responses_per_step: int, max_contention: float, use_clean: bool) -> dict:
    """Medians over the measured steps (after warm-up) of every run of one framework.

    With ``use_clean`` the timing rows use only the "clean" steps, those during which other
    processes used less than ``max_contention`` of the machine's cores; otherwise every
    measured step. The caller decides for both frameworks together, so they stay comparable."""
    measured = [(r, i) for r in runs for i in range(warmup, len(r["step_wall_s"]))]
    clean = clean_steps(runs, warmup, max_contention)
    use = clean if use_clean else measured
    out = {"runs": len(runs), "measured_steps": len(measured), "clean_steps": len(clean),
           "clean": use is clean, "max_contention": max_contention,
           "step_s_all": median([r["step_wall_s"][i] for r, i in measured]),
           "contention_median": median([r["step_contention"][i] for r, i in measured])}
    out["step_s"] = median([r["step_wall_s"][i] for r, i in use])
    out["step_s_min"] = min(r["step_wall_s"][i] for r, i in measured)
    out["step_cpu_s"] = median([r["step_cpu_s"][i] for r, i in use])
    for phase in PHASES:
        out[phase] = median([r["phases"][phase][i] for r, i in use if phase in r["phases"]])
    # everything else (framework overhead, advantages, batch building, data loading), per step
    out["other"] = median([r["step_wall_s"][i] - sum(r["phases"][p][i] for p in PHASES if p in r["phases"])
                           for r, i in use])
    out["response_length_mean"] = median([r["response_length_mean"][i] for r, i in measured])
    # normalized by the tokens actually generated (both are forced to the full length, so this is a check)
    out["ms_per_response_token"] = 1000 * out["step_s"] / (responses_per_step * out["response_length_mean"])
    out["process_peak_rss_mib"] = median([r["process_peak_rss_mib"] for r in runs])
    out["train_peak_rss_mib"] = median([r["train_peak_rss_mib"] for r in runs])
    # step 1's rollout: later rollouts start with whatever the allocator kept from the update before
    out["rollout_peak_rss_mib"] = median([r["rollout_peak_rss_mib"][0] for r in runs])
    out["update_peak_rss_mib"] = median([max(r["update_peak_rss_mib"]) for r in runs])
    out["baseline_rss_mib"] = median([r["baseline_rss_mib"] for r in runs])
    out["train_delta_rss_mib"] = median([r["train_peak_rss_mib"] - r["baseline_rss_mib"] for r in runs])
    out["setup_s"] = median([r["setup_s"] for r in runs])
    out["peak_reset"] = all(r["peak_reset"] for r in runs)
    return out


def wait_for_quiet(max_wait: float, threshold: float = 0.15) -> float:
    """Wait (up to ``max_wait`` s) until other processes use less than ``threshold`` of the cores."""
    from _common import machine_busy_s

    ncpu = os.cpu_count() or 1
    start = time.perf_counter()
    while True:
        before = machine_busy_s()
        time.sleep(1.0)
        share = (machine_busy_s() - before) / ncpu
        if share < threshold or time.perf_counter() - start > max_wait:
            return share


ROWS = [
    ("step wall time, median (s)", "step_s", "{:.3f}"),
    ("  (median over all measured steps) (s)", "step_s_all", "{:.3f}"),
    ("step wall time, best (s)", "step_s_min", "{:.3f}"),
    ("step CPU time, median (s)", "step_cpu_s", "{:.3f}"),
    ("  generate (s)", "generate", "{:.3f}"),
    ("  score (s)", "score", "{:.4f}"),
    ("  log-prob passes, no grad (s)", "logprobs", "{:.4f}"),
    ("  update: fwd+bwd+clip+step (s)", "train", "{:.3f}"),
    ("  weight sync (s)", "weight_sync", "{:.4f}"),
    ("  other (s)", "other", "{:.3f}"),
    ("response tokens / response", "response_length_mean", "{:.1f}"),
    ("ms per response token", "ms_per_response_token", "{:.3f}"),
    ("peak RSS, whole process (MiB)", "process_peak_rss_mib", "{:.0f}"),
    ("RSS after load, before step 1 (MiB)", "baseline_rss_mib", "{:.0f}"),
    ("peak RSS during training (MiB)", "train_peak_rss_mib", "{:.0f}"),
    ("  of which added by training (MiB)", "train_delta_rss_mib", "{:.0f}"),
    ("  peak in step 1's rollout (generate+score) (MiB)", "rollout_peak_rss_mib", "{:.0f}"),
    ("  peak in update (fwd+bwd+step) (MiB)", "update_peak_rss_mib", "{:.0f}"),
]


def table(size: str, spec: dict, ours: dict, trl: dict, markdown: bool = False) -> str:
    lines = []
    header = ["metric", "gspo-lightning", "TRL GRPOTrainer", "ours / TRL"]
    rows = []
    for label, key, fmt in ROWS:
        a, b = ours.get(key, float("nan")), trl.get(key, float("nan"))
        ratio = f"{a / b:.2f}x" if b and b == b and abs(b) > 1e-9 and a == a else "-"
        rows.append([label, fmt.format(a), fmt.format(b), ratio])
    title = (f"{size}: {spec['model']} ({spec['params_m']:.1f}M params, vocab {spec['vocab_size']}), "
             f"{spec['prompts_per_step']} prompts x G={spec['group_size']} = {spec['prompts_per_step'] * spec['group_size']} "
             f"responses of {spec['response_length']} tokens per step, prompts <= {spec['max_prompt_tokens']} tokens "
             f"(mean {spec['prompt_tokens_mean']:.1f}); {ours['measured_steps']} / {trl['measured_steps']} measured steps "
             f"over {ours['runs']} / {trl['runs']} runs, {spec['warmup']} warm-up steps per run dropped; timings are "
             f"medians over the {ours['clean_steps'] if ours['clean'] else ours['measured_steps']} / "
             f"{trl['clean_steps'] if trl['clean'] else trl['measured_steps']} steps "
             + ("during which other processes used < {:.0%} of the cores".format(ours["max_contention"])
                if ours["clean"] and trl["clean"] else "(too few uncontended steps: all measured steps; the machine was busy)"))
    if markdown:
        lines.append(f"**{title}**\n")
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        lines += ["| " + " | ".join([r[0].replace("  ", "&emsp;", 1), *r[1:]]) + " |" for r in rows]
    else:
        lines.append(title)
        widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
        fmt_row = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
        lines.append(fmt_row(header))
        lines.append("  ".join("-" * w for w in widths))
        lines += [fmt_row(r) for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", action="append", choices=sorted(SIZES), help="repeatable; default: tiny and small")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: per size)")
    parser.add_argument("--warmup", type=int, help="first steps of each run left out of the medians (default: per size)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per framework, alternated gspo/trl (default 2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads in both (default: all cores)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frameworks", default="gspo,trl", help="comma list; both are needed for ratios")
    parser.add_argument("--data", default=None, help="GSM8K train.jsonl (default: shared/data/gsm8k/train.jsonl)")
    parser.add_argument("--workdir", default=None, help="keep models, prompts and child logs here (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write every raw number and the summary here")
    parser.add_argument("--markdown", default=None, help="write the tables as markdown here")
    parser.add_argument("--profile", action="store_true", help="cProfile our measured steps (gspo_profile.prof per run)")
    parser.add_argument("--gspo-set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra GSPOModule argument for our runs (YAML value), e.g. logprob_chunk_size=256")
    parser.add_argument("--gspo-patch", default="", help="Python file our child runs first (try a change without editing the package)")
    parser.add_argument("--max-contention", type=float, default=0.1,
                        help="a step counts as clean when other processes used less than this share of the cores")
    parser.add_argument("--min-clean-steps", type=int, default=4,
                        help="uncontended measured steps wanted per framework; runs are added until there are (up to --max-runs)")
    parser.add_argument("--max-runs", type=int, default=4, help="most runs per framework and size")
    parser.add_argument("--extra-runs-until", type=float, default=900,
                        help="add no extra run once the benchmark has been going this many seconds")
    parser.add_argument("--wait-quiet", type=float, default=30,
                        help="before each run, wait up to this many seconds for other processes to go quiet")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per child run")
    args = parser.parse_args(argv)

    t_start = time.perf_counter()
    sizes = args.size or ["tiny", "small"]
    import yaml

    overrides = {}
    for item in args.gspo_set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    gspo_patch = str(Path(args.gspo_patch).resolve()) if args.gspo_patch else ""
    frameworks = [f for f in args.frameworks.split(",") if f]
    data = args.data or default_gsm8k()
    tmp = tempfile.TemporaryDirectory(prefix="bench_vs_trl_") if args.workdir is None else None
    workdir = Path(args.workdir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    report = {"sizes": {}, "argv": sys.argv[1:], "gspo_overrides": overrides, "gspo_patch": gspo_patch}
    texts, markdowns = [], []
    try:
        for size in sizes:
            spec = dict(SIZES[size])
            spec["steps"] = args.steps or spec["steps"]
            spec["warmup"] = spec["warmup"] if args.warmup is None else args.warmup
            if spec["steps"] <= spec["warmup"]:
                parser.error(f"--steps ({spec['steps']}) must exceed --warmup ({spec['warmup']})")
            folder = workdir / size
            t = time.perf_counter()
            info = build_model(spec["model"], folder / "model", args.seed)
            prompts = write_prompts(info["tokenizer"], data, folder / "prompts.jsonl", spec["max_prompt_tokens"],
                                    spec["prompts_per_step"] * spec["steps"])
            spec.update(params_m=info["params_m"], vocab_size=info["vocab_size"], **prompts)
            print(f"[{size}] model {spec['model']} saved to {folder / 'model'} and {prompts['prompts']} prompts "
                  f"written in {time.perf_counter() - t:.1f}s", flush=True)
            runs = {f: [] for f in frameworks}

            def lacking() -> list[str]:
                if time.perf_counter() - t_start > args.extra_runs_until:
                    return []
                return [f for f in frameworks if len(clean_steps(runs[f], spec["warmup"], args.max_contention)) < args.min_clean_steps
                        and len(runs[f]) < args.max_runs]

            rep = -1
            while True:
                rep += 1
                todo = frameworks if rep < args.repeats else lacking()
                if not todo:
                    break
                if rep >= args.repeats:
                    print(f"[{size}] too few uncontended steps for {', '.join(todo)}: one more run", flush=True)
                for framework in todo:
                    cfg = BenchConfig(
                        size=size, model_dir=str(folder / "model"), prompts_file=str(folder / "prompts.jsonl"),
                        prompts_per_step=spec["prompts_per_step"], group_size=spec["group_size"],
                        response_length=spec["response_length"], steps=spec["steps"], warmup=spec["warmup"],
                        lr=args.lr, threads=args.threads, seed=args.seed,
                        out_dir=str(folder / f"{framework}_{rep}"),
                        cprofile=str(folder / f"{framework}_{rep}" / "gspo_profile.prof") if args.profile and framework == "gspo" else "",
                        gspo_overrides=overrides, gspo_patch=gspo_patch,
                    )
                    busy = wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else float("nan")
                    result = run_child(framework, cfg, args.timeout)
                    result["busy_before"] = busy
                    runs[framework].append(result)
                    steps = result["step_wall_s"][spec["warmup"]:]
                    print(f"[{size}] {framework} run {rep + 1}: median step {median(steps):.3f}s, "
                          f"train peak RSS {result['train_peak_rss_mib']:.0f} MiB, process peak "
                          f"{result['wait4_maxrss_mib']:.0f} MiB, child wall {result['child_wall_s']:.1f}s, "
                          f"others used {median(result['step_contention'][spec['warmup']:]):.0%} of the cores "
                          f"(median over steps)", flush=True)
            responses = spec["prompts_per_step"] * spec["group_size"]
            use_clean = all(len(clean_steps(runs[f], spec["warmup"], args.max_contention)) >= args.min_clean_steps
                            for f in frameworks)
            summary = {f: summarize(runs[f], spec["warmup"], responses, args.max_contention, use_clean) for f in frameworks}
            report["sizes"][size] = {"spec": spec, "summary": summary, "runs": runs}
            if set(frameworks) >= {"gspo", "trl"}:
                texts.append(table(size, spec, summary["gspo"], summary["trl"]))
                markdowns.append(table(size, spec, summary["gspo"], summary["trl"], markdown=True))
                print("\n" + texts[-1] + "\n", flush=True)
        first = next(iter(report["sizes"].values()))["runs"]
        any_run = next(iter(first.values()))[0]
        report["versions"] = any_run["versions"]
        print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
        for size, entry in report["sizes"].items():
            s = entry["summary"]
            if "gspo" in s and "trl" in s:
                print(f"[{size}] ours/TRL: step time {s['gspo']['step_s'] / s['trl']['step_s']:.2f}x, "
                      f"peak RSS in training {s['gspo']['train_peak_rss_mib'] / s['trl']['train_peak_rss_mib']:.2f}x, "
                      f"training's RSS increase {s['gspo']['train_delta_rss_mib'] / max(s['trl']['train_delta_rss_mib'], 1e-9):.2f}x")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        if args.markdown:
            Path(args.markdown).write_text("\n\n".join(markdowns) + "\n")
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


if __name__ == "__main__":
    sys.exit(main())
