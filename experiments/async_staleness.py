"""Asynchronous GSPO on a CPU: overlap speed-up and learning under bounded staleness.

One command regenerates ``docs/results/async/`` (``summary.json``, stamped with the commit,
and ``README.md``)::

    python experiments/async_staleness.py --out docs/results/async            # ~40 min on 2 loaded cores
    python experiments/async_staleness.py --only staleness --out docs/results/async  # the staleness table alone
    python experiments/async_staleness.py --smoke --out /tmp/async-smoke      # every arm, 2 steps

Two experiments on the quickstart task (``builtin:successor``, ``builtin:tiny-successor``
from random weights, 16 prompts x 8 responses of 6 tokens, 4 mini-batches per rollout):

* ``speed``: seconds per rollout step and reward, synchronous (``max_staleness: 0``) vs
  ``k = 1, 2``, with two engines that hold their own weights: ``HFCopyEngine`` in float32
  (generation on a background thread of the trainer's process) and ``RemoteEngine`` (the
  same HF sampling loop in a rollout server process the run starts); and the default
  ``HFEngine`` (no copy) at ``k = 0`` for reference. Arms run one after another per seed, so the machine
  load is shared alike; the ratio within a seed is the number to read.
* ``staleness``: the objectives of ``METHODS`` (GSPO: sequence ratios, clip 3e-4 / 4e-4; GRPO:
  token ratios, 0.2 / 0.27; SAPO's soft gate at token and at sequence level; CISPO; GMPO;
  ``--methods`` picks some) at ``k = 0, 1, 2, 4``, each ``none`` (recomputed old policy, no
  weight: the staleness is silently ignored), ``decoupled`` (recomputed old policy, truncated
  importance weight at the level of the loss: ``seq`` geometric mean for the sequence-level
  methods, ``token`` for the others) and ``bypass`` (the engine's log-probs as the old policy:
  the clip sees numerics + staleness + update): final reward and the clip fraction by cause
  (``clip_budget/*``; for SAPO the saturated gate's, docs/async.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "GSPO": dict(importance_sampling="seq", clip_low=3e-4, clip_high=4e-4),
    "GRPO": dict(importance_sampling="token", clip_low=0.2, clip_high=0.27),
    # the paper's SAPO: token ratios, gate temperatures 1.0 / 1.05
    "SAPO-token": dict(importance_sampling="token", policy_loss_type="sapo"),
    # SAPO on GSPO's sequence ratio, its gate sized to GSPO's range: the weight is 1/2 at s = 1 +- 4e-4
    # (|tau (s - 1)| = 1.763); the paper's tau = 1 would leave it open at sequence scale (docs/algorithm.md)
    "SAPO-seq": dict(importance_sampling="seq", policy_loss_type="sapo", sapo_tau_pos=4400.0, sapo_tau_neg=4620.0),
    # CISPO at token level, weights in [0, 5] (ScaleRL's, as SkyRL's defaults)
    "CISPO": dict(importance_sampling="token", policy_loss_type="cispo", clip_low=1.0, clip_high=4.0),
    "GMPO": dict(importance_sampling="seq", policy_loss_type="gmpo", clip_low=0.4, clip_high=0.4),
}
CORRECTIONS = ("none", "decoupled", "bypass")
SETUP = {
    "speed": dict(ks=[0, 1, 2], seeds=[0, 1, 2], steps=40),
    "staleness": dict(ks=[0, 1, 2, 4], seeds=[0, 1, 2, 3, 4], steps=40),
}
BUDGET = ("clip_budget/clip_frac", "clip_budget/numerics", "clip_budget/staleness", "clip_budget/update",
          "clip_budget/numerics_alone", "clip_budget/staleness_alone", "loss/clip_frac", "off_policy/ess",
          "off_policy/bounded_frac", "async/lag")


ENGINES = {
    "HFEngine": None,  # the policy itself: no overlap possible
    "copy": {"class_path": "gspo_lightning.rollout.HFCopyEngine", "init_args": {"dtype": "float32"}},
    # the same HF sampling loop in a rollout server process started by the run (no shared GIL)
    "server": {"class_path": "gspo_lightning.rollout.RemoteEngine",
               "init_args": {"urls": None, "server_engine": {"class_path": "gspo_lightning.rollout.HFEngine"},
                             "server_threads": 1}},
}


# seconds per step in the trainer: generation (on the producer when k >= 1), the wait for the
# producer, the updates; within one run, so less exposed to the machine's load than s/step across runs
TIMES = ("time/generate", "time/score", "time/wait_rollout", "time/train", "time/logprobs", "time/weight_sync")


def config(folder: Path, *, seed: int, steps: int, k: int, engine: str, method: str = "GSPO",
           correction: str = "none") -> Path:
    model = {
        "model_name_or_path": "builtin:tiny-successor",
        "rewards": [{"function": "gspo_lightning.data.tasks.successor.successor_reward"}],
        "num_return_sequences_in_group": 8, "response_length": 6, "adv_estimator": "grpo",
        "loss_agg_mode": "seq-mean-token-mean", "mini_batch_size": 32, "max_staleness": k, "clip_budget": True,
        "export_on_fit_end": False,
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.001, "weight_decay": 0.0}},
        **METHODS[method],
    }
    if ENGINES[engine] is not None:
        model["engine"] = ENGINES[engine]
    if correction == "decoupled":
        level = "token" if METHODS[method]["importance_sampling"] == "token" else "seq"
        model["off_policy"] = {"mode": "decoupled", "level": level, "method": "truncate"}
    if correction == "bypass":
        model["old_logprobs"] = "engine"
    cfg = {
        "seed_everything": seed,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": steps, "limit_val_batches": 0,
                    "num_sanity_val_steps": 0, "enable_progress_bar": False, "enable_model_summary": False,
                    "enable_checkpointing": False, "default_root_dir": str(folder),
                    "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                                "init_args": {"save_dir": str(folder), "name": "csv"}}]},
        "model": model,
        "data": {"path": "builtin:successor", "rollout_batch_size": 16, "prompt_length": 8, "val_size": 0},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(cfg: Path, reuse: bool = False) -> dict:
    """Fit in a fresh process (or, with ``reuse``, read a finished run's logs); returns the
    per-step logged rows and the wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.time()
    if not (reuse and list(cfg.parent.glob("csv/version_*/metrics.csv"))):
        out = subprocess.run([sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(cfg)], cwd=ROOT, env=env,
                             capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
    rows = []
    for file in sorted(cfg.parent.glob("csv/version_*/metrics.csv")):
        with open(file) as handle:
            rows += [{k: float(v) for k, v in row.items() if v and v != "nan"}  # nan: not measured at that step
                     for row in csv.DictReader(handle) if row.get("policy_version")]
    return {"rows": rows, "wall_s": time.time() - start}


def summarize(result: dict, skip: int = 3) -> dict:
    rows = result["rows"]
    steady = rows[skip:] or rows
    tail = rows[-5:]
    out = {
        "step_s": statistics.mean(r["time/step"] for r in steady),
        "final_reward": statistics.mean(r["reward/mean"] for r in tail),
        "reward_curve": [round(r["reward/mean"], 4) for r in rows],
        "wall_s": result["wall_s"],
    }
    for name in BUDGET + TIMES:
        values = [r[name] for r in steady if name in r]
        if values:
            out[name] = statistics.mean(values)
    return out


def stamp(argv: list[str]) -> dict:
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "dirty": git("status", "--porcelain", "--untracked-files=no").splitlines(),
            "command": "python " + " ".join(argv), "load_at_start": list(os.getloadavg()), "cpus": os.cpu_count(),
            "python": platform.python_version()}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="every arm, 2 steps, 1 seed")
    parser.add_argument("--only", choices=list(SETUP), default=None)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                        help="the staleness experiment's methods (default: all)")
    parser.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=list(CORRECTIONS),
                        help="the staleness experiment's corrections (default: all)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="staleness runs at once (each one single-threaded process; the speed runs stay one at a time)")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="a previous run's work folder: read the finished runs' logs instead of running them again")
    args = parser.parse_args(argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"stamp": stamp(argv), "setup": SETUP, "methods": {m: METHODS[m] for m in args.methods}, "speed": {},
               "staleness": {}}
    previous = args.out / "summary.json"
    if args.reuse and previous.exists():  # the runs were made then: keep that stamp
        summary["stamp"] = {**json.loads(previous.read_text())["stamp"], "summarized_by": "python " + " ".join(argv)}
    began = time.time()
    work = args.reuse or Path(tempfile.mkdtemp(prefix="async-staleness-"))
    print(f"work folder: {work}", flush=True)
    for name in ([args.only] if args.only else list(SETUP)):
        setup = SETUP[name]
        seeds, steps = (setup["seeds"][:1], 4) if args.smoke else (setup["seeds"], setup["steps"])
        for seed in seeds:
            if name == "speed":
                arms = [("HFEngine k=0", 0, "HFEngine")] + [(f"{engine} k={k}", k, engine) for engine in ("copy", "server")
                                                             for k in setup["ks"]]
                for label, k, engine in arms:
                    result = summarize(run(config(work / f"speed-{label}-{seed}".replace(" ", "_").replace("=", ""), seed=seed,
                                                  steps=steps, k=k, engine=engine), args.reuse is not None))
                    summary["speed"].setdefault(label, {})[seed] = result
                    print(f"speed {label} seed {seed}: {result['step_s']:.3f} s/step, reward {result['final_reward']:.3f}", flush=True)
            else:
                arms = [(f"{method} k={k} {correction}", config(work / f"st-{method}-{k}-{correction}-{seed}", seed=seed,
                                                              steps=steps, k=k, engine="copy", method=method,
                                                              correction=correction))
                        for method in args.methods for k in setup["ks"] for correction in args.corrections]
                # each run is one single-threaded process, seeded: --jobs changes the wall time, not the numbers
                with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                    results = pool.map(lambda arm: summarize(run(arm[1], args.reuse is not None)), arms)
                    for (label, _), result in zip(arms, results):
                        summary["staleness"].setdefault(label, {})[seed] = result
                        print(f"{label} seed {seed}: reward {result['final_reward']:.3f} clip "
                              f"{result.get('clip_budget/clip_frac', float('nan')):.4f}", flush=True)
            if not args.reuse:
                summary["stamp"]["wall_min"] = round((time.time() - began) / 60, 1)
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if summary["staleness"]:
        plot_curves(summary["staleness"], args.out)
    (args.out / "README.md").write_text(readme(summary))


def avg(seeds: dict, *keys: str) -> str:
    """Mean over seeds of the sum of ``keys`` (seconds per step)."""
    values = [sum(seeds[x][k] for k in keys) for x in seeds if all(k in seeds[x] for k in keys)]
    return f"{statistics.mean(values):.3f}" if values else "-"


# -- the staleness experiment's analysis: the comparisons and rules below were fixed before its runs --
# A difference is significant when its 95% interval over the paired seeds excludes 0 (a seed fixes the
# initial weights and the prompts of every arm). "learning" is the mean training reward over all steps
# (the area under the curve: an arm that stops learning early scores low), "final" the last 5 steps'.
GATE_QUESTIONS = [
    # (a, b, question): a - b at each k >= 1, correction bypass (the engine's log-probs as the old policy,
    # so the clip or gate sees the staleness) and none (the staleness ignored)
    ("SAPO-seq", "GSPO", "a soft gate at sequence level keeps learning where GSPO's hard clip saturates"),
    ("SAPO-token", "GRPO", "the paper's token-level soft gate against the token-level hard clip"),
    ("CISPO", "GRPO", "CISPO's clipped weight (every token keeps a gradient) against the token-level hard clip"),
]


def learning(seed_result: dict) -> float:
    curve = seed_result["reward_curve"]
    return sum(curve) / len(curve)


def _ci(values: list[float]) -> tuple[float, float]:
    from paper_in_miniature import ci  # the same t-intervals as docs/results
    entry = ci(values)
    return entry["mean"], entry["ci95"] or 0.0


def _paired(a: dict, b: dict, value) -> tuple[float, float, int]:
    diffs = [value(a[x]) - value(b[x]) for x in a if x in b]
    mean, half = _ci(diffs)
    return mean, half, (1 if mean - half > 0 else -1 if mean + half < 0 else 0) if len(diffs) > 1 else 0


def _cell(mean: float, half: float, sign: int = 0) -> str:
    text = f"{mean:+.3f} ± {half:.3f}"
    return f"**{text}**" if sign else text


def gate_verdict(rows: list[tuple[int, str, tuple, tuple]]) -> str:
    """From (k, correction, learning diff, final diff): yes when a is significantly ahead somewhere
    and never significantly behind; no when significantly behind somewhere and never ahead."""
    signs = [d[2] for _, _, learn, final in rows for d in (learn, final)]
    ahead, behind = any(x > 0 for x in signs), any(x < 0 for x in signs)
    if ahead and not behind:
        return "yes"
    if behind and not ahead:
        return "no: worse"
    return "mixed" if ahead else "no difference shown"


def staleness_section(arms: dict) -> list[str]:
    methods = list(dict.fromkeys(label.split(" ")[0] for label in arms))
    ks = sorted({int(label.split(" ")[1][2:]) for label in arms})
    seeds = sorted({x for r in arms.values() for x in r})
    lines = ["## Staleness: reward and clip (or gate saturation) by cause", "",
             f"Seeds {seeds}; every arm the same compute (40 rollout steps of 16 prompts x 8 responses). Means over seeds "
             "with 95% intervals. `learning`: mean training reward over all steps; `final`: the last 5 steps'. `clip`: "
             "the clip fraction (sequences at sequence level, tokens at token level; for SAPO the share of units whose "
             "gate is saturated, for CISPO of clipped weights); numerics / staleness / update: its partition by dominant "
             "cause (docs/async.md); `ess`: normalized effective sample size of the correction's weights.", "",
             "| arm | learning | final | clip | numerics | staleness | update | ess |", "|---|---|---|---|---|---|---|---|"]
    for label, by_seed in arms.items():
        def mean(key):
            values = [by_seed[x][key] for x in by_seed if key in by_seed[x]]
            return f"{statistics.mean(values):.4f}" if values else "-"
        learn = _ci([learning(r) for r in by_seed.values()])
        final = _ci([r["final_reward"] for r in by_seed.values()])
        lines.append(f"| {label} | {learn[0]:.3f} ± {learn[1]:.3f} | {final[0]:.3f} ± {final[1]:.3f} | "
                     f"{mean('clip_budget/clip_frac')} | {mean('clip_budget/numerics')} | {mean('clip_budget/staleness')} | "
                     f"{mean('clip_budget/update')} | {mean('off_policy/ess')} |")
    lines += ["", "## Does a soft gate keep learning where the hard clip saturates?", "",
              "Paired differences `a - b` (seed by seed; **bold**: the 95% interval excludes 0), with the engine's "
              "log-probs as the old policy (`bypass`: the clip or gate sees the staleness), with the staleness "
              "ignored (`none`) and corrected by a truncated importance weight (`decoupled`), as far as the run has "
              "them. The rule, fixed before the run: *yes* when `a` is significantly ahead in some cell "
              "and significantly behind in none; *no: worse* the reverse; *mixed* both; otherwise *no difference shown*.", ""]
    verdicts = []
    for a, b, question in GATE_QUESTIONS:
        if a not in methods or b not in methods:
            continue
        lines += [f"**{a} - {b}**: {question}.", "", "| k | correction | learning | final | clip of a | clip of b |",
                  "|---|---|---|---|---|---|"]
        rows = []
        for k in ks:
            for correction in ("bypass", "none", "decoupled"):
                la, lb = f"{a} k={k} {correction}", f"{b} k={k} {correction}"
                if la not in arms or lb not in arms:
                    continue
                learn = _paired(arms[la], arms[lb], learning)
                final = _paired(arms[la], arms[lb], lambda r: r["final_reward"])
                clip = lambda label: statistics.mean(r.get("clip_budget/clip_frac", float("nan")) for r in arms[label].values())
                lines.append(f"| {k} | {correction} | {_cell(*learn)} | {_cell(*final)} | {clip(la):.3f} | {clip(lb):.3f} |")
                if k >= 1:
                    rows.append((k, correction, learn, final))
        verdicts.append((f"{a} vs {b} under staleness (k >= 1)", gate_verdict(rows)))
        lines.append("")
    lines += ["## What staleness costs each method", "",
              "`k=4 - k=0` per method and correction, on `learning` (paired by seed; **bold**: significant).", "",
              "| method | " + " | ".join(CORRECTIONS) + " |", "|---|" + "---|" * len(CORRECTIONS)]
    for method in methods:
        cells = []
        for correction in CORRECTIONS:
            hi, lo = f"{method} k={max(ks)} {correction}", f"{method} k=0 {correction}"
            cells.append(_cell(*_paired(arms[hi], arms[lo], learning)) if hi in arms and lo in arms else "-")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "## Verdicts", "", "| question | verdict |", "|---|---|"]
    lines += [f"| {q} | **{v}** |" for q, v in verdicts]
    lines += ["", "Reward curves (means over seeds): `staleness_curves.png`.", ""]
    return lines


def plot_curves(arms: dict, out: Path) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    methods = list(dict.fromkeys(label.split(" ")[0] for label in arms))
    ks = sorted({int(label.split(" ")[1][2:]) for label in arms})
    fig, axes = plt.subplots(2, len(ks), figsize=(4 * len(ks), 6.5), sharey=True, squeeze=False)
    for row, correction in enumerate(("bypass", "decoupled")):
        for col, k in enumerate(ks):
            ax = axes[row][col]
            for method in methods:
                runs = arms.get(f"{method} k={k} {correction}")
                if runs:
                    curves = [r["reward_curve"] for r in runs.values()]
                    width = min(len(c) for c in curves)
                    ax.plot([statistics.mean(c[i] for c in curves) for i in range(width)], label=method)
            ax.set_title(f"k={k}, {correction}")
            ax.set_xlabel("rollout step")
            if col == 0:
                ax.set_ylabel("training reward (mean over seeds)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = out / "staleness_curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def readme(summary: dict) -> str:
    s = summary["stamp"]
    lines = [
        "# Asynchronous GSPO: speed and staleness", "",
        "Generated by `python experiments/async_staleness.py` (see its docstring); numbers from `summary.json`. "
        "How to read them, and what they show: [docs/async.md](../../async.md#measured).", "",
        f"- commit `{s['commit']}` (tracked files changed at the time: {', '.join(s['dirty']) or 'none'})",
        f"- command `{s['command']}`, wall time {s.get('wall_min', '?')} min",
        f"- {s['cpus']} CPUs, load average at start {[round(x, 2) for x in s['load_at_start']]} (on a shared machine "
        "timings are provisional: compare arms within a seed)", "",
    ]
    if summary["speed"]:
        lines += ["## Speed: seconds per rollout step (mean after 3 warm-up steps) and final reward (mean of the last 5 steps)", "",
                  "| arm | s/step per seed | mean s/step | vs the same engine at k=0 (per-seed ratio, mean) | generate + score s | waited s | train s | final reward per seed |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, seeds in summary["speed"].items():
            base = summary["speed"].get(label.split(" ")[0] + " k=0", {})
            times = [seeds[x]["step_s"] for x in seeds]
            ratios = [seeds[x]["step_s"] / base[x]["step_s"] for x in seeds if x in base]
            rewards = ", ".join(f"{seeds[x]['final_reward']:.3f}" for x in seeds)
            lines.append(f"| {label} | {', '.join(f'{t:.3f}' for t in times)} | {statistics.mean(times):.3f} | "
                         f"{statistics.mean(ratios):.2f}x | {avg(seeds, 'time/generate', 'time/score')} | {avg(seeds, 'time/wait_rollout')} | "
                         f"{avg(seeds, 'time/train')} | {rewards} |")
        lines.append("")
    else:
        lines += ["## Speed", "", "Not in this run (`--only staleness`): the speed of `max_staleness: 1` against the "
                  "synchronous loop is measured on the full quickstart by `benchmarks/bench_async.py` "
                  "(`bench_async.json` here, the table in [docs/async.md](../../async.md#measured)).", ""]
    if summary["staleness"]:
        lines += staleness_section(summary["staleness"])
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv)
