"""The GSPO paper's findings (section 7 of shared/GSPO.md), in miniature, on a CPU.

Trains a dense (``builtin:tiny-echo``) and a Mixture-of-Experts (``builtin:tiny-moe-echo``)
tiny model from random weights by RL alone, with

* ``GSPO``     importance_sampling=seq,   clip 3e-4 / 4e-4, seq-mean-token-mean
* ``GRPO``     importance_sampling=token, clip 0.2 / 0.27,  seq-mean-token-mean
* ``GRPO+RR``  GRPO with Routing Replay (MoE only)

over several seeds at equal compute: every run sees the same number of rollouts and takes
the same number of optimizer steps (``MINI_BATCHES`` mini-batches per rollout, so the old
policy goes stale and clipping acts). Writes to ``docs/results/`` (or ``--out``):

* ``reward_curves.png``, ``clip_fraction.png``, ``kl_and_ratios.png``, ``routing_change.png``
* ``summary.json`` (per model and method: final reward mean/std over seeds, clip fractions, ...)
* ``curves.json`` (per step, per seed: the metrics behind the plots)

Run ``python experiments/paper_in_miniature.py`` (two single-threaded runs at a time:
about 10 minutes on an idle 2-core CPU, about 15 minutes on a busy one; ``--jobs 1``
doubles that) or ``--smoke`` (one seed, a few steps, under a minute). Results do not depend
on ``--jobs``: every run is seeded and single-threaded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]

MODELS = {"dense": "builtin:tiny-echo", "moe": "builtin:tiny-moe-echo"}
METHODS: dict[str, dict[str, Any]] = {
    "GSPO": dict(importance_sampling="seq", clip_low=3e-4, clip_high=4e-4, loss_agg_mode="seq-mean-token-mean"),
    "GRPO": dict(importance_sampling="token", clip_low=0.2, clip_high=0.27, loss_agg_mode="seq-mean-token-mean"),
    "GRPO+RR": dict(importance_sampling="token", clip_low=0.2, clip_high=0.27, loss_agg_mode="seq-mean-token-mean",
                    routing_replay=True),
}
MOE_ONLY = {"GRPO+RR"}

# The shared setup of every run (equal compute: same rollouts, same optimizer steps).
SETUP = dict(
    task="alternate",  # gspo_lightning/tasks/alternate.py: `repeat 3 7` -> `3 7 3 7 3 7 3 7`
    reward="gspo_lightning.tasks.alternate.alternate_reward",
    prompts_per_rollout=16,
    group_size=8,  # num_return_sequences_in_group: 128 responses per rollout
    mini_batches=4,  # optimizer steps per rollout (the paper's 4): 32 responses each
    response_length=10,
    seeds=[0, 1, 2],
    # two learning-rate regimes: a tuned one, and a 3x larger "stress" one where updates
    # move the policy (and the router) far between rollouts
    regimes={"standard": dict(lr=3e-3, rollout_steps=200), "stress": dict(lr=1e-2, rollout_steps=120)},
)
SMOKE = dict(seeds=[0], prompts_per_rollout=4,
             regimes={"standard": dict(lr=3e-3, rollout_steps=3), "stress": dict(lr=1e-2, rollout_steps=3)})

METRICS = [
    "reward/mean", "loss/clip_frac", "loss/clip_frac_tokens", "loss/ratio_min", "loss/ratio_max", "kl",
    "entropy", "grad_norm", "moe/routing_change", "response/length_mean", "skipped_updates",
]


# -- one extra metric, through the update loop's hook --------------------------------------
def clip_frac_tokens(micro) -> dict:
    """The share of response *tokens* whose ratio is clipped, whatever the ratio level (for
    sequence ratios every token of a clipped sequence counts): the paper's Figure 2 unit.
    ``micro`` is a :class:`gspo_lightning.update.MicroBatch`."""
    import torch

    from gspo_lightning.loss import MAX_LOG_RATIO, log_importance_ratio

    s = micro.settings
    valid = micro.mask.bool()
    zeros = torch.zeros_like(micro.logprobs)
    lp = torch.where(valid, micro.logprobs, zeros)
    old = torch.where(valid, micro.old_logprobs.to(lp.dtype), zeros)
    adv = micro.advantages[:, None].expand_as(lp) if micro.advantages.dim() == 1 else micro.advantages
    ratio = torch.exp(log_importance_ratio(lp, old, micro.mask, s.importance_sampling).clamp(max=MAX_LOG_RATIO))
    low = (ratio < 1.0 - s.clip_low) & (adv < 0) & valid
    high = (ratio > 1.0 + s.clip_high) & (adv > 0) & valid
    tokens = valid.sum()
    return {"loss/clip_frac_tokens": ((low | high).sum() / tokens.clamp(min=1), tokens)}


# -- one run -----------------------------------------------------------------------------
def run_one(regime: str, model_key: str, method: str, seed: int, setup: dict, work_dir: str) -> dict:
    """Train one (regime, model, method, seed); return the per-rollout-step metrics.
    ``setup``: :data:`SETUP` with the regime's ``lr`` and ``rollout_steps`` merged in."""
    import contextlib
    import io
    import logging

    import lightning as L
    import torch

    from gspo_lightning.data import PromptDataModule
    from gspo_lightning.rewards import RewardSpec

    from gspo_lightning.module import GSPOModule

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    history: dict[str, list[Optional[float]]] = {name: [] for name in METRICS}

    class Collect(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            metrics = trainer.callback_metrics
            for name in METRICS:
                value = metrics.get(name)
                history[name].append(None if value is None else float(value))

    G = setup["group_size"]
    responses = setup["prompts_per_rollout"] * G
    module = GSPOModule(
        model_name_or_path=MODELS[model_key],
        rewards=[RewardSpec(function=setup["reward"])],
        num_return_sequences_in_group=G,
        response_length=setup["response_length"],
        adv_estimator="grpo",
        mini_batch_size=responses // setup["mini_batches"],
        use_kl_loss=True, kl_loss_coef=0.0,  # a reference for the KL metric; the objective is unchanged
        optimizer=lambda params: torch.optim.AdamW(params, lr=setup["lr"], weight_decay=0.0),
        **METHODS[method],
        metric_hooks=[clip_frac_tokens],
        export_on_fit_end=False,  # only the metrics matter here
    )
    data = PromptDataModule(path=f"builtin:{setup['task']}", tokenizer=MODELS[model_key], rollout_batch_size=setup["prompts_per_rollout"],
                            prompt_length=8, val_size=8, seed=seed)
    L.seed_everything(seed, verbose=False)  # the same initial weights and prompts for every method
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=setup["rollout_steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=os.path.join(work_dir, f"{regime}-{model_key}-{method}-{seed}"), callbacks=[Collect()],
    )
    start = time.perf_counter()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the built-in plotter's print
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    return {"regime": regime, "model": model_key, "method": method, "seed": seed,
            "seconds": time.perf_counter() - start, "optimizer_steps": module.policy_version, "history": history}


def _run_job(args):
    return run_one(*args)


# -- analysis ----------------------------------------------------------------------------
SMOOTH = 10  # moving-average window of the plots and of "best reward"


def _series(runs: list[dict], name: str):
    import numpy as np

    length = min(len(r["history"][name]) for r in runs)
    return np.array([[np.nan if v is None else v for v in r["history"][name][:length]] for r in runs], dtype=float)


def _final(values, frac=0.1):
    """Mean over the last ``frac`` of steps, per seed."""
    import numpy as np

    n = max(1, int(math.ceil(values.shape[1] * frac)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values[:, -n:], axis=1)


def _nanmean(x) -> Optional[float]:
    import numpy as np

    x = np.asarray(x, dtype=float)
    return None if np.all(np.isnan(x)) else float(np.nanmean(x))


def _smooth(y, window):
    import numpy as np

    if window <= 1 or len(y) < window:
        return np.asarray(y, dtype=float)
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, y[0]), y])
    return np.convolve(padded, kernel, mode="valid")


def _select(results, regime=None, model=None, method=None):
    return [r for r in results if (regime is None or r["regime"] == regime) and (model is None or r["model"] == model)
            and (method is None or r["method"] == method)]


def summarize(results: list[dict], setup: dict, seconds: float) -> dict:
    import numpy as np

    summary: dict[str, Any] = {
        "setup": {**setup, "models": MODELS, "methods": METHODS},
        "definitions": {
            "final_reward": "mean training reward over the last 10% of rollout steps, per seed; mean/std over seeds",
            "best_reward": f"highest {SMOOTH}-step moving average of the reward, per seed; mean over seeds",
            "drop_from_best": "best_reward - final_reward per seed, mean over seeds (a collapse shows as a large drop)",
            "mean_clip_frac": "clipped share per rollout step, mean over steps and seeds; unit: clip_frac_unit",
            "mean_clip_frac_tokens": "clipped share counted in tokens (for GSPO: the tokens of clipped sequences)",
            "final_kl_to_init": "k3 KL(policy || initial policy) per response token, last 10% of steps",
            "mean_routing_change": "share of (valid token, MoE layer) whose top-k expert set under the current "
                                   "policy differs from the old policy's, mean over the training forwards after "
                                   "the first update of each rollout",
        },
        "runtime_s": round(seconds, 1),
        "results": {},
    }
    for regime in setup["regimes"]:
        for model_key in MODELS:
            for method in METHODS:
                runs = _select(results, regime, model_key, method)
                if not runs:
                    continue
                reward = _series(runs, "reward/mean")
                final = _final(reward)
                best = np.array([np.nanmax(_smooth(np.nan_to_num(v), SMOOTH)) for v in reward])
                entry = {
                    "seeds": [r["seed"] for r in runs],
                    "final_reward_mean": round(float(np.mean(final)), 4),
                    "final_reward_std": round(float(np.std(final)), 4),
                    "final_reward_per_seed": [round(float(v), 4) for v in final],
                    "best_reward_mean": round(float(np.mean(best)), 4),
                    "drop_from_best": round(float(np.mean(best - final)), 4),
                    "mean_clip_frac": _nanmean(_series(runs, "loss/clip_frac")),
                    "clip_frac_unit": "sequences" if METHODS[method]["importance_sampling"] != "token" else "tokens",
                    "mean_clip_frac_tokens": _nanmean(_series(runs, "loss/clip_frac_tokens")),
                    "final_kl_to_init": _nanmean(_final(_series(runs, "kl"))),
                    "mean_log_ratio_max": _nanmean(np.log(_series(runs, "loss/ratio_max"))),
                    "mean_log_ratio_min": _nanmean(np.log(_series(runs, "loss/ratio_min"))),
                    "skipped_updates": int(sum((r["history"]["skipped_updates"][-1] or 0) for r in runs)),
                    "optimizer_steps": runs[0]["optimizer_steps"],
                    "seconds_per_run": round(float(np.mean([r["seconds"] for r in runs])), 1),
                }
                if model_key == "moe":
                    entry["mean_routing_change"] = _nanmean(_series(runs, "moe/routing_change"))
                    if METHODS[method].get("routing_replay"):
                        entry["routing_change_note"] = ("experts the router would have chosen differently; "
                                                        "the replay forced the recorded ones")
                summary["results"].setdefault(regime, {}).setdefault(model_key, {})[method] = entry
    return summary


COLORS = {"GSPO": "tab:blue", "GRPO": "tab:red", "GRPO+RR": "tab:green"}


def plot(results: list[dict], setup: dict, out: Path, smooth: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def band(ax, runs, name, label, color, transform=None, linestyle="-"):
        values = _series(runs, name)
        if transform is not None:
            values = transform(values)
        if np.all(np.isnan(values)):
            return
        rows = []
        for v in values:
            fill = np.nanmean(v) if not np.all(np.isnan(v)) else 0.0
            rows.append(_smooth(np.where(np.isnan(v), fill, v), smooth))
        smoothed = np.array(rows)
        steps = np.arange(1, smoothed.shape[1] + 1)
        mean, std = smoothed.mean(0), smoothed.std(0)
        ax.plot(steps, mean, color=color, label=label, linewidth=1.4, linestyle=linestyle)
        if len(runs) > 1:
            ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.18, linewidth=0)

    regimes = [r for r in setup["regimes"] if _select(results, regime=r)]
    seeds = len({r["seed"] for r in results})
    note = f"mean over {seeds} seed(s), band = ±1 std over seeds" + (f", {smooth}-step moving average" if smooth > 1 else "")

    def title(regime):
        return f"{regime} (lr {setup['regimes'][regime]['lr']:g})"

    def grid(metric_fn, ylabel, name, suptitle, log=False, legend_size=9):
        fig, axes = plt.subplots(len(regimes), len(MODELS), figsize=(11, 3.6 * len(regimes)), squeeze=False)
        for i, regime in enumerate(regimes):
            for j, model_key in enumerate(MODELS):
                ax = axes[i, j]
                for method in METHODS:
                    runs = _select(results, regime, model_key, method)
                    if runs:
                        metric_fn(ax, runs, method)
                if log:
                    ax.set_yscale("log")
                ax.set_title(f"{title(regime)} — {model_key} ({MODELS[model_key]})", fontsize=10)
                ax.set_xlabel(f"rollout step ({setup['mini_batches']} optimizer steps each)")
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3, which="both" if log else "major")
                ax.legend(fontsize=legend_size)
        fig.suptitle(f"{suptitle} — {note}", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        return out / name

    paths = [
        grid(lambda ax, runs, m: band(ax, runs, "reward/mean", m, COLORS[m]), "mean reward (alternate task)",
             "reward_curves.png", "Training reward"),
    ]

    def clip(ax, runs, method):
        seq = METHODS[method]["importance_sampling"] != "token"
        band(ax, runs, "loss/clip_frac", f"{method} ({'sequences' if seq else 'tokens'})", COLORS[method])
        if seq:
            band(ax, runs, "loss/clip_frac_tokens", f"{method} (tokens of clipped sequences)", COLORS[method],
                 linestyle="--")

    paths.append(grid(clip, "fraction clipped (log)", "clip_fraction.png", "Clipped fraction per step", log=True,
                      legend_size=7))
    paths.append(grid(lambda ax, runs, m: band(ax, runs, "kl", m, COLORS[m]), "KL(policy || initial), k3",
                      "kl.png", "KL to the initial policy"))

    def ratios(ax, runs, method):
        log = lambda v: np.log(np.clip(v, 1e-12, None))  # noqa: E731
        band(ax, runs, "loss/ratio_max", f"{method} max", COLORS[method], transform=log)
        band(ax, runs, "loss/ratio_min", f"{method} min", COLORS[method], transform=log, linestyle="--")

    paths.append(grid(ratios, "log importance ratio", "importance_ratios.png",
                      "log importance ratio, max / min per step (GRPO: tokens, GSPO: sequences)", legend_size=7))

    fig, axes = plt.subplots(1, len(regimes), figsize=(5.5 * len(regimes), 3.8), squeeze=False)
    for ax, regime in zip(axes[0], regimes):
        for method in METHODS:
            runs = _select(results, regime, "moe", method)
            if runs:
                replay = METHODS[method].get("routing_replay")
                band(ax, runs, "moe/routing_change", method + (" (would change; replay forced old)" if replay else ""),
                     COLORS[method])
        ax.set_title(f"{title(regime)} — MoE: share of (token, layer)\nwith a changed top-k expert set, old vs current",
                     fontsize=10)
        ax.set_xlabel("rollout step")
        ax.set_ylabel("routing change")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "routing_change.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths


def _compact(results: list[dict]) -> dict:
    """Per-step curves per run, rounded (the data behind the plots)."""
    keep = ["reward/mean", "loss/clip_frac", "loss/clip_frac_tokens", "kl", "moe/routing_change",
            "loss/ratio_max", "loss/ratio_min"]
    out: dict[str, Any] = {}
    for r in results:
        key = f"{r['regime']}/{r['model']}/{r['method']}/seed{r['seed']}"
        out[key] = {name: [None if v is None else float(f"{v:.3g}") for v in r["history"][name]]
                    for name in keep if any(v is not None for v in r["history"][name])}
    return out


def _from_curves(curves: dict) -> list[dict]:
    """Runs (as :func:`run_one` returns them, histories only) back from ``curves.json``."""
    results = []
    for key, history in curves.items():
        regime, model_key, method, seed = key.split("/")
        length = len(history["reward/mean"])
        full = {name: history.get(name, [None] * length) for name in METRICS}
        results.append({"regime": regime, "model": model_key, "method": method, "seed": int(seed[len("seed"):]),
                        "history": full})
    return results


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"), help="output folder")
    parser.add_argument("--smoke", action="store_true", help="1 seed, a few steps: checks the pipeline in < 1 min")
    parser.add_argument("--seeds", type=int, nargs="*", help="override the seeds")
    parser.add_argument("--regimes", nargs="*", choices=list(SETUP["regimes"]), default=list(SETUP["regimes"]))
    parser.add_argument("--steps", type=int, help="override the rollout steps of every regime")
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--methods", nargs="*", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="runs in parallel (processes, one thread each; default: 2 or the CPU count)")
    parser.add_argument("--replot", action="store_true",
                        help="redraw the plots from the summary.json and curves.json in --out; train nothing")
    parser.add_argument("--smooth", type=int, help=f"moving-average window of the plots (default {SMOOTH}, smoke 1)")
    args = parser.parse_args(argv)

    setup = json.loads(json.dumps(SETUP))
    if args.smoke:
        setup.update(json.loads(json.dumps(SMOKE)))
    if args.seeds:
        setup["seeds"] = args.seeds
    setup["regimes"] = {name: regime for name, regime in setup["regimes"].items() if name in args.regimes}
    if args.steps:
        for regime in setup["regimes"].values():
            regime["rollout_steps"] = args.steps
    smooth = args.smooth if args.smooth is not None else (1 if args.smoke else SMOOTH)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        summary = json.loads((out / "summary.json").read_text())
        results = _from_curves(json.loads((out / "curves.json").read_text()))
        if args.smooth is None and len(next(iter(results))["history"]["reward/mean"]) < 3 * SMOOTH:
            smooth = 1
        paths = plot(results, summary["setup"], out, smooth)
        print(f"redrew {', '.join(p.name for p in paths)} in {out}")
        return summary

    jobs = [(regime, m, method, seed, {**setup, **params})
            for regime, params in setup["regimes"].items() for seed in setup["seeds"]
            for m in args.models for method in args.methods if not (method in MOE_ONLY and m != "moe")]
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="paper_in_miniature-") as work_dir:
        jobs = [(*job, work_dir) for job in jobs]
        if args.jobs > 1:
            import multiprocessing as mp

            with mp.get_context("spawn").Pool(args.jobs, maxtasksperchild=1) as pool:
                for result in pool.imap_unordered(_run_job, jobs):
                    results.append(result)
                    _report(result, len(results), len(jobs), start)
        else:
            for job in jobs:
                results.append(_run_job(job))
                _report(results[-1], len(results), len(jobs), start)
    seconds = time.perf_counter() - start
    order = list(setup["regimes"]), list(MODELS), list(METHODS)
    results.sort(key=lambda r: (order[0].index(r["regime"]), order[1].index(r["model"]), order[2].index(r["method"]), r["seed"]))

    summary = summarize(results, setup, seconds)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "curves.json").write_text(json.dumps(_compact(results), separators=(",", ":")) + "\n")
    paths = plot(results, setup, out, smooth)
    print(f"wrote summary.json, curves.json, {', '.join(p.name for p in paths)} to {out} in {seconds:.0f} s")
    for regime, models in summary["results"].items():
        for model_key, methods in models.items():
            for method, e in methods.items():
                print(f"  {regime:8s} {model_key:5s} {method:8s} final reward {e['final_reward_mean']:.3f} ± "
                      f"{e['final_reward_std']:.3f} (best {e['best_reward_mean']:.3f})  clip {e['mean_clip_frac']:.2e} "
                      f"{e['clip_frac_unit']}, {e['mean_clip_frac_tokens']:.2e} tokens")
    return summary


def _report(result: dict, done: int, total: int, start: float) -> None:
    reward = [v for v in result["history"]["reward/mean"] if v is not None]
    tail = reward[-max(1, len(reward) // 10):]
    print(f"[{done}/{total} {time.perf_counter() - start:5.0f} s] {result['regime']} {result['model']} "
          f"{result['method']} seed {result['seed']}: final reward {sum(tail) / len(tail):.3f} "
          f"({result['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
