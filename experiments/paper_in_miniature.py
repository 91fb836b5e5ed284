"""The GSPO paper's claims, in miniature, on a CPU, each pushed to where its mechanism bites.

One command regenerates everything in ``docs/results/``, ``README.md`` included (its tables
and verdicts come from the ``summary.json`` this writes, by ``experiments/results_readme.py``)::

    python experiments/paper_in_miniature.py --out docs/results      # the full run, ~1 h on 2 cores
    python experiments/paper_in_miniature.py --smoke --out /tmp/s    # every experiment, tiny: seconds
    python experiments/paper_in_miniature.py --replot --out docs/results

Tiny models are trained from random weights by RL alone on the ``pattern`` task
(``gspo_lightning/data/tasks/pattern.py``: prompt ``repeat 3 7``, answer ``3 7 3 7 ...`` for
``length`` words, reward = share of positions right; 20 held-out digit pairs never trained on).
Methods (``METHODS``): GSPO (sequence ratios, clip 3e-4 / 4e-4), GRPO (token ratios, clip
0.2 / 0.27), GRPO+RR (GRPO with Routing Replay); all ``seq-mean-token-mean``, group-normalized
advantages, AdamW, grad-norm clip 1. Every arm of an experiment has the same compute: the
same rollouts, responses and optimizer steps. Experiments (``SETUP``):

* ``length``: token clip fraction of GSPO and GRPO as the response length grows (16 -> 256),
  and, at one length, as the learning rate shrinks towards the paper's regime;
* ``dense``: GSPO vs GRPO at equal compute, 5 seeds, training and held-out reward;
* ``moe``: a Qwen3-MoE with 16 experts, top-2, no shared expert, 8 mini-batches per rollout
  and a high learning rate (real routing drift): GSPO vs GRPO vs GRPO+RR, 5 seeds;
* ``precision``: rollouts from a bf16 / fp16 / bf16+fp8-weights copy of the policy
  (``gspo_lightning.rollout.HFCopyEngine``) whose log-probs are used directly as pi_old
  (``old_logprobs=engine``), trainer in fp32; against the fp32 recompute baseline.

Outputs: ``summary.json`` (stamp: commit, dirty files, command line, versions, seeds, wall
time, machine load; per arm: means with 95% t-intervals over seeds), ``curves.json`` (per
step, per run), ``mismatch.json.gz`` (engine-vs-trainer samples, gzipped: ~3 MB as text) and the plots.
Runs are seeded and single-threaded: ``--jobs`` changes the wall time, not the numbers.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]

MODELS = {"dense": "builtin:tiny-echo", "moe": "builtin:tiny-moe16-echo"}
_COMMON = dict(loss_agg_mode="seq-mean-token-mean")
METHODS: dict[str, dict[str, Any]] = {
    "GSPO": dict(importance_sampling="seq", clip_low=3e-4, clip_high=4e-4, **_COMMON),
    "GRPO": dict(importance_sampling="token", clip_low=0.2, clip_high=0.27, **_COMMON),
    "GRPO+RR": dict(importance_sampling="token", clip_low=0.2, clip_high=0.27, routing_replay=True, **_COMMON),
}
# engine arms of the precision experiment: HFCopyEngine knobs (None: HFEngine + recompute)
ENGINES: dict[str, Optional[dict]] = {
    "fp32 recompute": None,
    "fp16 engine": dict(dtype="float16"),
    "bf16 engine": dict(dtype="bfloat16"),
    "bf16+fp8 engine": dict(dtype="bfloat16", weight_quantization="fp8"),
    "bf16+fp8 recompute": dict(dtype="bfloat16", weight_quantization="fp8", recompute=True),
}

SETUP: dict[str, Any] = {
    "task": "pattern",
    "group_size": 8,
    "experiments": {
        "length": dict(model="dense", methods=["GSPO", "GRPO"], lengths=[16, 32, 64, 128, 256], lr=3e-3,
                       lr_sweep=dict(length=64, lrs=[3e-4, 1e-3]), prompts=8, mini_batches=4, steps=20,
                       seeds=[0, 1, 2]),
        "dense": dict(model="dense", methods=["GSPO", "GRPO"], length=8, lr=3e-3, prompts=16, mini_batches=4,
                      steps=100, seeds=[0, 1, 2, 3, 4]),
        # a load-balancing loss keeps all 16 experts in use (without it the router collapses onto a few
        # and the routing stops changing); 8 updates per rollout at lr 1e-2 move the router far from pi_old's
        "moe": dict(model="moe", methods=["GSPO", "GRPO", "GRPO+RR"], length=8, lr=1e-2, prompts=16,
                    mini_batches=8, router_aux_loss_coef=0.01, steps=100, seeds=[0, 1, 2, 3, 4]),
        "precision": dict(model="dense", methods=["GSPO", "GRPO"], lengths=[8, 32], engines=list(ENGINES),
                          lr=3e-3, prompts=8, mini_batches=4, steps=50, seeds=[0, 1, 2, 3, 4]),
    },
}
SMOKE: dict[str, Any] = {
    "length": dict(lengths=[8], lr_sweep=dict(length=8, lrs=[1e-3]), prompts=2, steps=2, seeds=[0]),
    "dense": dict(prompts=2, steps=2, seeds=[0, 1]),
    "moe": dict(prompts=2, steps=2, seeds=[0]),
    "precision": dict(lengths=[8], engines=["fp32 recompute", "bf16 engine", "bf16+fp8 recompute"], prompts=2, steps=2,
                      seeds=[0]),
}
HELDOUT_PROMPTS = 20  # the held-out digit pairs, each once, greedy

METRICS = [
    "reward/mean", "loss/clip_frac", "loss/clip_frac_tokens", "loss/clip_frac_first_minibatch", "loss/ratio_min",
    "loss/ratio_max", "entropy", "grad_norm", "moe/routing_change", "response/length_mean", "skipped_updates",
    "engine/logprob_abs_diff", "engine/seq_log_ratio_abs_max", "probe/token_abs_diff_max",
]


# -- per-update metrics, through the update loop's hooks ------------------------------------
def clip_frac_tokens(micro) -> dict:
    """The share of response *tokens* whose ratio is clipped, whatever the ratio level (for
    sequence ratios every token of a clipped sequence counts): the paper's Figure 2 unit.
    ``micro`` is a :class:`gspo_lightning.training.update.MicroBatch`."""
    import torch

    from gspo_lightning.objective.loss import MAX_LOG_RATIO, log_importance_ratio

    objective = micro.settings.objective
    clip = objective.resolved  # PPOClip, its clip range filled in for the level
    valid = micro.mask.bool()
    zeros = torch.zeros_like(micro.logprobs)
    lp = torch.where(valid, micro.logprobs, zeros)
    old = torch.where(valid, micro.old_logprobs.to(lp.dtype), zeros)
    adv = micro.advantages[:, None].expand_as(lp) if micro.advantages.dim() == 1 else micro.advantages
    ratio = torch.exp(log_importance_ratio(lp, old, micro.mask, objective.importance_sampling).clamp(max=MAX_LOG_RATIO))
    low = (ratio < 1.0 - clip.clip_low) & (adv < 0) & valid
    high = (ratio > 1.0 + clip.clip_high) & (adv > 0) & valid
    tokens = valid.sum()
    return {"loss/clip_frac_tokens": ((low | high).sum() / tokens.clamp(min=1), tokens)}


class MismatchProbe:
    """The old-vs-trainer log-prob gap in the first mini-batch of each rollout, before any
    update: with ``old_logprobs=engine`` exactly the engine/trainer precision mismatch the
    clip sees. Keeps per-sequence mean log ratios and a sample of per-token differences.
    ``new_rollout()`` is called by a callback at the start of each rollout step."""

    def __init__(self, token_samples_per_step: int = 64):
        self.first = False
        self.seq: list[float] = []
        self.tokens: list[float] = []
        self.per_step = token_samples_per_step

    def new_rollout(self) -> None:
        self.first = True

    def __call__(self, micro) -> dict:
        import torch

        if not self.first:
            return {}
        self.first = False
        valid = micro.mask.bool()
        diff = torch.where(valid, micro.logprobs - micro.old_logprobs.to(micro.logprobs.dtype), torch.zeros_like(micro.logprobs))
        lengths = valid.sum(-1)
        keep = lengths > 0
        self.seq.extend((diff.sum(-1)[keep] / lengths[keep]).tolist())
        tokens = diff[valid]
        if tokens.numel():
            pick = torch.randperm(tokens.numel(), generator=torch.Generator().manual_seed(len(self.tokens)))[:self.per_step]
            self.tokens.extend(tokens[pick].tolist())
            return {"probe/token_abs_diff_max": (tokens.abs().max(), 1)}
        return {}


# -- the plan: one dict per run -----------------------------------------------------------
def plan(setup: dict) -> list[dict]:
    runs = []
    base = dict(task=setup["task"], group=setup["group_size"])
    for exp, cfg in setup["experiments"].items():
        common = dict(base, experiment=exp, model=cfg["model"], prompts=cfg["prompts"], mini_batches=cfg["mini_batches"],
                      steps=cfg["steps"], router_aux_loss_coef=cfg.get("router_aux_loss_coef", 0.0))
        arms = []
        if exp == "length":
            for length in cfg["lengths"]:
                for method in cfg["methods"]:
                    arms.append(dict(arm=f"{method} L{length}", method=method, length=length, lr=cfg["lr"]))
            sweep = cfg.get("lr_sweep")
            if sweep:
                for lr in sweep["lrs"]:
                    for method in cfg["methods"]:
                        arms.append(dict(arm=f"{method} L{sweep['length']} lr{lr:g}", method=method,
                                         length=sweep["length"], lr=lr))
        elif exp == "precision":
            for length in cfg["lengths"]:
                for engine in cfg["engines"]:
                    for method in cfg["methods"]:
                        arms.append(dict(arm=f"{method} L{length} {engine}", method=method, length=length, lr=cfg["lr"],
                                         engine=engine))
        else:
            for method in cfg["methods"]:
                arms.append(dict(arm=method, method=method, length=cfg["length"], lr=cfg["lr"]))
        for arm in arms:
            for seed in cfg["seeds"]:
                runs.append({**common, **arm, "seed": seed, "heldout": True})
    return runs


def cost(run: dict) -> float:
    """Relative run time, to start the longest runs first."""
    per_token = 1.0 + (2.0 if run["model"] == "moe" else 0.0)
    return run["steps"] * run["prompts"] * run["group"] * (20 + run["length"] * per_token)


# -- one run -----------------------------------------------------------------------------
def run_one(run: dict, work_dir: str) -> dict:
    """Train one run of :func:`plan`; return its per-rollout-step metrics and held-out score."""
    import contextlib
    import io
    import logging

    import lightning as L
    import torch

    from gspo_lightning.data.datamodule import PromptDataModule
    from gspo_lightning.errors import NonFiniteError
    from gspo_lightning.training.module import GSPOModule
    from gspo_lightning.rewards import RewardSpec
    from gspo_lightning.rollout import HFCopyEngine
    from gspo_lightning.data.tasks import pattern

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("gspo_lightning.training.update").setLevel(logging.ERROR)
    history: dict[str, list[Optional[float]]] = {name: [] for name in METRICS}
    probe = MismatchProbe()

    class Collect(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            probe.new_rollout()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            metrics = trainer.callback_metrics
            for name in METRICS:
                value = metrics.get(name)
                history[name].append(None if value is None else float(value))

    name = f"{run['experiment']}-{run['arm']}-{run['seed']}".replace(" ", "_")
    folder = Path(work_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    data_path = folder / "train.jsonl"
    with open(data_path, "w") as handle:
        for row in pattern.make_rows(4000, run["seed"], run["length"], "train"):
            handle.write(json.dumps(row) + "\n")

    engine_name = run.get("engine")
    knobs = dict(ENGINES[engine_name] or {}) if engine_name else {}
    recompute = knobs.pop("recompute", False) or not engine_name or ENGINES[engine_name] is None
    engine = HFCopyEngine(**knobs) if knobs else None
    model_path = MODELS[run["model"]]
    responses = run["prompts"] * run["group"]
    module = GSPOModule(
        model_name_or_path=model_path,
        rewards=[RewardSpec(function="gspo_lightning.data.tasks.pattern.pattern_reward")],
        num_return_sequences_in_group=run["group"],
        response_length=run["length"],
        adv_estimator="grpo",
        mini_batch_size=responses // run["mini_batches"],
        optimizer=lambda params: torch.optim.AdamW(params, lr=run["lr"], weight_decay=0.0),
        engine=engine,
        old_logprobs="recompute" if recompute else "engine",
        router_aux_loss_coef=run.get("router_aux_loss_coef", 0.0),
        **METHODS[run["method"]],
        metric_hooks=[clip_frac_tokens, probe],
        export_on_fit_end=False,  # only the metrics matter here
    )
    data = PromptDataModule(path=str(data_path), tokenizer=model_path, rollout_batch_size=run["prompts"],
                            prompt_length=8, val_size=None, seed=run["seed"])
    L.seed_everything(run["seed"], verbose=False)  # the same initial weights and prompts for every arm
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=run["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(folder), callbacks=[Collect()],
    )
    start = time.perf_counter()
    failure = None
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the built-in plotter's print
        warnings.simplefilter("ignore")
        try:
            from gspo_lightning.run import attach_run_callbacks

            attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
            trainer.fit(module, datamodule=data)
        except NonFiniteError as err:  # a collapse is a result, not a crash of the experiment
            failure = f"step {len(history['reward/mean'])}: {err}"
    seconds = time.perf_counter() - start
    heldout = heldout_score(module, run["length"]) if run.get("heldout") else None
    return {**run, "seconds": seconds, "optimizer_steps": module.policy_version, "history": history,
            "heldout": heldout, "failure": failure,
            "mismatch": {"seq": [float(f"{v:.4g}") for v in probe.seq],
                         "tokens": [float(f"{v:.4g}") for v in probe.tokens]}}


def heldout_score(module, length: int) -> dict:
    """Greedy responses of the trained fp32 policy to the 20 held-out digit pairs (never in
    training), scored by the task's reward: mean reward and exact-answer accuracy."""
    from gspo_lightning.models.loading import eos_token_ids
    from gspo_lightning.rollout import EngineSpec, HFEngine, SamplingParams
    from gspo_lightning.data.tasks import pattern

    tok = module.tokenizer
    rows = pattern.heldout_rows(length)  # the 20 held-out pairs, once each
    engine = HFEngine()
    engine.start(EngineSpec(model_name_or_path="", dtype="float32", prompt_length=8, response_length=length, seed=0,
                            eos_token_ids=eos_token_ids(module.policy, tok), pad_token_id=tok.pad_token_id,
                            policy=module.policy, tokenizer=tok))
    ids = [tok(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows]
    gen = engine.generate(ids, 1, SamplingParams(length, temperature=0.0), seed=0)
    texts = tok.batch_decode([r[:n] for r, n in zip(gen.completion_ids.tolist(), gen.lengths.tolist())],
                             skip_special_tokens=True)
    scores = pattern.pattern_reward([r["prompt"] for r in rows], texts, [r["target"] for r in rows])
    return {"reward": sum(scores) / len(scores), "accuracy": sum(s >= 1.0 for s in scores) / len(scores),
            "prompts": len(rows)}


def _run_job(args):
    return run_one(*args)


# -- statistics ------------------------------------------------------------------------------
# two-sided 95% Student t quantiles by degrees of freedom (no scipy here)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(df: int) -> float:
    if df in T95:
        return T95[df]
    below = [k for k in T95 if k <= df]
    return T95[max(below)] if below else float("nan")


def ci(values) -> dict:
    """Mean and 95% t-interval half-width over seeds (``None`` values ignored)."""
    xs = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not xs:
        return {"mean": None, "ci95": None, "n": 0}
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return {"mean": round(mean, 5), "ci95": None, "n": 1}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return {"mean": round(mean, 5), "ci95": round(t95(len(xs) - 1) * sd / math.sqrt(len(xs)), 5), "n": len(xs)}


def _values(history: list, frac: Optional[float] = None, start: float = 0.0) -> list[float]:
    xs = [v for v in history if v is not None]
    if frac is not None:
        xs = xs[-max(1, int(math.ceil(len(xs) * frac))):] if xs else xs
    elif start:
        xs = xs[int(len(xs) * start):]
    return xs


def _mean(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def _quantiles(xs: list[float], qs=(0.5, 0.9, 0.99)) -> dict:
    if not xs:
        return {}
    s = sorted(abs(x) for x in xs)
    return {f"p{int(q * 100)}": float(f"{s[min(len(s) - 1, int(q * len(s)))]:.3g}") for q in qs} | {"max": float(f"{s[-1]:.3g}")}


SMOOTH = 5
COLLAPSE_DROP = 0.1  # a seed "collapsed" when its final reward is this far below its best moving average


def _smooth(y, window):
    import numpy as np

    y = np.asarray(y, dtype=float)
    if window <= 1 or len(y) < window:
        return y
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, y[0]), y])
    return np.convolve(padded, kernel, mode="valid")


def arm_entry(runs: list[dict]) -> dict:
    """Per-arm numbers: mean and 95% interval over seeds of per-seed values."""
    per_seed: dict[str, list] = {k: [] for k in (
        "final_reward", "heldout_reward", "heldout_accuracy", "clip_frac", "clip_frac_tokens", "clip_frac_tokens_late",
        "clip_frac_first_minibatch", "routing_change", "response_length", "engine_logprob_abs_diff",
        "drop_from_best", "log_ratio_min", "grad_norm")}
    for r in runs:
        h = r["history"]
        reward = _values(h["reward/mean"])
        final = _mean(_values(h["reward/mean"], frac=0.1))
        per_seed["final_reward"].append(final)
        smoothed = _smooth(reward, SMOOTH) if reward else []
        per_seed["drop_from_best"].append(float(max(smoothed)) - final if len(smoothed) and final is not None else None)
        per_seed["heldout_reward"].append(r["heldout"]["reward"] if r.get("heldout") else None)
        per_seed["heldout_accuracy"].append(r["heldout"]["accuracy"] if r.get("heldout") else None)
        per_seed["clip_frac"].append(_mean(_values(h["loss/clip_frac"])))
        per_seed["clip_frac_tokens"].append(_mean(_values(h["loss/clip_frac_tokens"])))
        per_seed["clip_frac_tokens_late"].append(_mean(_values(h["loss/clip_frac_tokens"], start=0.5)))
        per_seed["clip_frac_first_minibatch"].append(_mean(_values(h["loss/clip_frac_first_minibatch"])))
        per_seed["routing_change"].append(_mean(_values(h["moe/routing_change"])))
        per_seed["response_length"].append(_mean(_values(h["response/length_mean"])))
        per_seed["engine_logprob_abs_diff"].append(_mean(_values(h["engine/logprob_abs_diff"])))
        ratio_min = [math.log(max(v, 1e-30)) for v in _values(h["loss/ratio_min"])]
        per_seed["log_ratio_min"].append(_mean(ratio_min))
        per_seed["grad_norm"].append(_mean(_values(h["grad_norm"])))
    entry: dict[str, Any] = {"seeds": [r["seed"] for r in runs]}
    for key, values in per_seed.items():
        if any(v is not None for v in values):
            entry[key] = ci(values)
    entry["collapsed_seeds"] = sum(1 for r, drop in zip(runs, per_seed["drop_from_best"])
                                   if r.get("failure") or (drop is not None and drop > COLLAPSE_DROP))
    entry["final_reward_per_seed"] = [None if v is None else round(v, 4) for v in per_seed["final_reward"]]
    entry["heldout_reward_per_seed"] = [None if v is None else round(v, 4) for v in per_seed["heldout_reward"]]
    entry["failures"] = [r["failure"] for r in runs if r.get("failure")]
    entry["skipped_updates"] = int(sum((_values(r["history"]["skipped_updates"]) or [0])[-1] for r in runs))
    entry["optimizer_steps"] = runs[0]["optimizer_steps"]
    entry["seconds_per_run"] = round(sum(r["seconds"] for r in runs) / len(runs), 1)
    seq = [x for r in runs for x in r["mismatch"]["seq"]]
    tokens = [x for r in runs for x in r["mismatch"]["tokens"]]
    if seq:
        entry["first_minibatch_mismatch"] = {
            "seq_abs_log_ratio": _quantiles(seq), "token_abs_diff": _quantiles(tokens),
            "share_seq_beyond_gspo_clip": round(sum(abs(x) > 3e-4 for x in seq) / len(seq), 4),
            "share_tokens_beyond_grpo_clip": round(sum(abs(x) > 0.2 for x in tokens) / max(1, len(tokens)), 5),
        }
    return entry


def _paired_ratio(a_runs: list[dict], b_runs: list[dict], key: str = "loss/clip_frac_tokens", start: float = 0.0) -> dict:
    """Per-seed ratio a/b of a metric's mean (seeds pair: same initial weights and prompts)."""
    by_seed = {r["seed"]: r for r in b_runs}
    ratios = []
    for r in a_runs:
        other = by_seed.get(r["seed"])
        if other is None:
            continue
        a, b = _mean(_values(r["history"][key], start=start)), _mean(_values(other["history"][key], start=start))
        if a is not None and b:
            ratios.append(a / b)
    if not ratios:
        return {"geo_mean": None}
    logs = [math.log(x) for x in ratios if x > 0]
    out = ci(logs)
    geo = math.exp(out["mean"]) if out["mean"] is not None else None
    return {"geo_mean": None if geo is None else round(geo, 2), "per_seed": [round(x, 2) for x in ratios],
            "ci95_low": None if out["ci95"] is None else round(math.exp(out["mean"] - out["ci95"]), 2),
            "ci95_high": None if out["ci95"] is None else round(math.exp(out["mean"] + out["ci95"]), 2)}


def paired_difference(a: dict, b: dict, key: str) -> dict:
    """Arm ``a`` minus arm ``b`` of a per-seed value (``final_reward`` or ``heldout_reward``),
    seed by seed (a seed fixes the initial weights and prompts of both): mean and 95% interval."""
    a_by_seed = dict(zip(a["seeds"], a[f"{key}_per_seed"]))
    diffs = [a_by_seed[s] - v for s, v in zip(b["seeds"], b[f"{key}_per_seed"])
             if v is not None and a_by_seed.get(s) is not None]
    return ci(diffs)


# pairs compared seed by seed, per experiment: (a, b) means a - b
COMPARISONS = {
    "dense": [("GSPO", "GRPO")],
    "moe": [("GSPO", "GRPO"), ("GRPO+RR", "GRPO"), ("GSPO", "GRPO+RR")],
}


def comparisons(exp: str, arms: dict, setup: dict) -> list[dict]:
    """Paired differences of final and held-out reward: the method pairs of ``COMPARISONS``;
    for ``precision`` each engine arm against the fp32 recompute arm of the same method and length."""
    pairs = list(COMPARISONS.get(exp, []))
    if exp == "precision":
        cfg = setup["experiments"]["precision"]
        pairs = [(f"{m} L{n} {e}", f"{m} L{n} fp32 recompute") for n in cfg["lengths"] for m in cfg["methods"]
                 for e in cfg["engines"] if e != "fp32 recompute"]
    rows = []
    for a, b in pairs:
        if a in arms and b in arms:
            rows.append({"a": a, "b": b, **{key: paired_difference(arms[a], arms[b], key)
                                            for key in ("final_reward", "heldout_reward")}})
    return rows


def summarize(results: list[dict], setup: dict) -> dict:
    out: dict[str, Any] = {}
    for exp in setup["experiments"]:
        runs = [r for r in results if r["experiment"] == exp]
        arms: dict[str, list] = {}
        for r in runs:
            arms.setdefault(r["arm"], []).append(r)
        out[exp] = {"arms": {arm: arm_entry(sorted(rs, key=lambda r: r["seed"])) for arm, rs in arms.items()}}
        out[exp]["comparisons"] = comparisons(exp, out[exp]["arms"], setup)
        if exp == "length":
            cfg = setup["experiments"]["length"]
            table = []
            for length in cfg["lengths"]:
                g, r = arms.get(f"GSPO L{length}"), arms.get(f"GRPO L{length}")
                if g and r:
                    table.append({"length": length, "lr": cfg["lr"],
                                  "gspo_tokens": out[exp]["arms"][f"GSPO L{length}"]["clip_frac_tokens"],
                                  "grpo_tokens": out[exp]["arms"][f"GRPO L{length}"]["clip_frac_tokens"],
                                  "ratio": _paired_ratio(g, r), "ratio_second_half": _paired_ratio(g, r, start=0.5),
                                  "response_length": out[exp]["arms"][f"GSPO L{length}"]["response_length"]})
            out[exp]["by_length"] = table
            sweep = cfg.get("lr_sweep")
            if sweep:
                rows = []
                for lr in sorted([*sweep["lrs"], cfg["lr"]]):
                    suffix = f"L{sweep['length']}" + ("" if lr == cfg["lr"] else f" lr{lr:g}")
                    g, r = arms.get(f"GSPO {suffix}"), arms.get(f"GRPO {suffix}")
                    if g and r:
                        rows.append({"length": sweep["length"], "lr": lr,
                                     "gspo_tokens": out[exp]["arms"][f"GSPO {suffix}"]["clip_frac_tokens"],
                                     "grpo_tokens": out[exp]["arms"][f"GRPO {suffix}"]["clip_frac_tokens"],
                                     "ratio": _paired_ratio(g, r)})
                out[exp]["by_lr"] = rows
    return out


# -- plots -------------------------------------------------------------------------------------
COLORS = {"GSPO": "tab:blue", "GRPO": "tab:red", "GRPO+RR": "tab:green"}
ENGINE_COLORS = {"fp32 recompute": "black", "fp16 engine": "tab:green", "bf16 engine": "tab:orange",
                 "bf16+fp8 engine": "tab:red", "bf16+fp8 recompute": "tab:purple"}


def _errorbar(ax, xs, entries, key, **kw):
    ys = [e[key]["mean"] if e.get(key) else float("nan") for e in entries]
    err = [(e[key]["ci95"] or 0.0) if e.get(key) else 0.0 for e in entries]
    ax.errorbar(xs, ys, yerr=err, capsize=3, marker="o", **kw)


def _band(ax, runs, name, label, color, smooth, linestyle="-"):
    import numpy as np

    length = min(len(r["history"][name]) for r in runs)
    values = np.array([[np.nan if v is None else v for v in r["history"][name][:length]] for r in runs], dtype=float)
    if length == 0 or np.all(np.isnan(values)):
        return
    rows = [_smooth(np.where(np.isnan(v), np.nanmean(v) if not np.all(np.isnan(v)) else 0.0, v), smooth) for v in values]
    values = np.array(rows)
    steps = np.arange(1, values.shape[1] + 1)
    mean = values.mean(0)
    ax.plot(steps, mean, color=color, label=label, linewidth=1.4, linestyle=linestyle)
    if len(runs) > 1:
        half = t95(len(runs) - 1) * values.std(0, ddof=1) / np.sqrt(len(runs))
        ax.fill_between(steps, mean - half, mean + half, color=color, alpha=0.18, linewidth=0)


def plot(results: list[dict], summary: dict, setup: dict, out: Path, smooth: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    exps = setup["experiments"]

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        paths.append(out / name)

    def arm_runs(exp, arm):
        return sorted([r for r in results if r["experiment"] == exp and r["arm"] == arm], key=lambda r: r["seed"])

    # 1. clip fraction vs response length (and learning rate)
    if "length" in summary:
        s = summary["length"]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        rows = s.get("by_length", [])
        xs = [row["length"] for row in rows]
        for method, key in (("GSPO", "gspo_tokens"), ("GRPO", "grpo_tokens")):
            _errorbar(axes[0], xs, [{"v": row[key]} for row in rows], "v", color=COLORS[method],
                      label=f"{method} ({'tokens of clipped sequences' if method == 'GSPO' else 'tokens'})")
        axes[0].set(xscale="log", yscale="log", xlabel="response length (tokens)", ylabel="clipped share of tokens",
                    title=f"Clip fraction vs length (lr {exps['length']['lr']:g})")
        axes[0].set_xticks(xs, [str(x) for x in xs])
        for i, (key, label) in enumerate((("ratio", "all steps"), ("ratio_second_half", "second half of steps"))):
            ys = [row[key]["geo_mean"] or np.nan for row in rows]
            lo = [row[key].get("ci95_low") or y for row, y in zip(rows, ys)]
            hi = [row[key].get("ci95_high") or y for row, y in zip(rows, ys)]
            axes[1].errorbar(np.array(xs) * (1.04 if i else 1.0), ys,
                             yerr=[np.array(ys) - np.array(lo), np.array(hi) - np.array(ys)], capsize=3, marker="o",
                             label=label, color="black" if i == 0 else "gray")
        axes[1].set(xscale="log", yscale="log", xlabel="response length (tokens)", ylabel="GSPO / GRPO clipped tokens",
                    title="Ratio (geometric mean over seeds, 95% CI)")
        axes[1].axhline(100, color="tab:purple", linestyle=":", label="paper: ~100x")
        axes[1].set_xticks(xs, [str(x) for x in xs])
        lr_rows = s.get("by_lr", [])
        if lr_rows:
            lrs = [row["lr"] for row in lr_rows]
            for method, key in (("GSPO", "gspo_tokens"), ("GRPO", "grpo_tokens")):
                _errorbar(axes[2], lrs, [{"v": row[key]} for row in lr_rows], "v", color=COLORS[method], label=method)
            twin = axes[2].twinx()
            twin.plot(lrs, [row["ratio"]["geo_mean"] or np.nan for row in lr_rows], "k--", marker="s", label="ratio")
            twin.set_yscale("log")
            twin.set_ylabel("GSPO / GRPO (dashed)")
            axes[2].set(xscale="log", yscale="log", xlabel="learning rate", ylabel="clipped share of tokens",
                        title=f"Clip fraction vs learning rate (length {lr_rows[0]['length']})")
        from matplotlib.ticker import NullFormatter

        for ax in axes:
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
            ax.xaxis.set_minor_formatter(NullFormatter())
        save(fig, "clip_vs_length.png")

    # 2. reward curves and routing change: dense and MoE at equal compute
    curve_exps = [e for e in ("dense", "moe") if e in summary]
    if curve_exps:
        fig, axes = plt.subplots(2, len(curve_exps), figsize=(6.5 * len(curve_exps), 7.5), squeeze=False)
        for j, exp in enumerate(curve_exps):
            cfg = exps[exp]
            for method in cfg["methods"]:
                runs = arm_runs(exp, method)
                if runs:
                    _band(axes[0, j], runs, "reward/mean", method, COLORS[method], smooth)
                    if exp == "moe":
                        label = method + (" (would change; replay forced old)" if "RR" in method else "")
                        _band(axes[1, j], runs, "moe/routing_change", label, COLORS[method], smooth)
                    else:
                        _band(axes[1, j], runs, "loss/clip_frac_tokens", method, COLORS[method], smooth)
            axes[0, j].set(title=f"{exp}: {MODELS[cfg['model']]}, length {cfg['length']}, lr {cfg['lr']:g}, "
                                 f"{cfg['mini_batches']} mini-batches", xlabel="rollout step", ylabel="training reward")
            if exp == "moe":
                axes[1, j].set(title="MoE: share of (token, layer) whose top-2 experts changed since pi_old",
                               xlabel="rollout step", ylabel="routing change")
            else:
                axes[1, j].set(title="clipped share of tokens", xlabel="rollout step", yscale="log")
            for ax in axes[:, j]:
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        fig.suptitle(f"mean over seeds, band = 95% CI, {smooth}-step moving average", fontsize=9)
        save(fig, "reward_curves.png")

    # 3. final training reward and held-out reward per arm, with 95% CI
    bar_exps = [e for e in ("dense", "moe", "precision") if e in summary]
    if bar_exps:
        fig, axes = plt.subplots(1, len(bar_exps), figsize=(5 * len(bar_exps) + 4, 4.6), squeeze=False,
                                 gridspec_kw={"width_ratios": [len(summary[e]["arms"]) for e in bar_exps]})
        for ax, exp in zip(axes[0], bar_exps):
            arms = list(summary[exp]["arms"])
            x = np.arange(len(arms))
            for k, (key, label) in enumerate((("final_reward", "training reward (last 10%)"),
                                              ("heldout_reward", "held-out pairs, greedy"))):
                ys = [summary[exp]["arms"][a].get(key, {}).get("mean") or 0.0 for a in arms]
                es = [summary[exp]["arms"][a].get(key, {}).get("ci95") or 0.0 for a in arms]
                ax.bar(x + (k - 0.5) * 0.38, ys, 0.38, yerr=es, capsize=2, label=label,
                       color=["tab:blue", "tab:gray"][k], alpha=0.85)
            ax.set_xticks(x, arms, rotation=60 if len(arms) > 4 else 0, ha="right" if len(arms) > 4 else "center",
                          fontsize=7 if len(arms) > 4 else 9)
            ax.set(title=f"{exp} (95% CI over {len(exps[exp]['seeds'])} seeds)", ylabel="reward")
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8)
        save(fig, "final_rewards.png")

    # 4. precision: mismatch distributions, first-mini-batch clipping, curves
    if "precision" in summary:
        cfg = exps["precision"]
        fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
        bins = np.logspace(-9, 1, 61)
        for engine in cfg["engines"]:
            if ENGINES[engine] is not None and ENGINES[engine].get("recompute"):
                continue
            for n, length in enumerate(sorted({min(cfg["lengths"]), max(cfg["lengths"])})):
                mine = [r for r in results if r["experiment"] == "precision" and r.get("engine") == engine
                        and r["length"] == length]
                seq = [abs(x) for r in mine for x in r["mismatch"]["seq"]]
                tok = [abs(x) for r in mine for x in r["mismatch"]["tokens"]]
                style = dict(histtype="step", color=ENGINE_COLORS[engine], linestyle="-" if n == 0 else "--")
                if seq:
                    axes[0, 0].hist(np.clip(seq, 1e-9, None), bins=bins, label=f"{engine} L{length}", **style)
                if tok:
                    axes[0, 1].hist(np.clip(tok, 1e-9, None), bins=bins, label=f"{engine} L{length}", **style)
        axes[0, 0].axvline(3e-4, color="tab:blue", linestyle=":", label="GSPO clip 3e-4")
        axes[0, 0].set(xscale="log", xlabel="|sequence log ratio| trainer vs old, first mini-batch",
                       ylabel="sequences", title="Sequence-level mismatch (GSPO's log ratio before any update)")
        axes[0, 1].axvline(0.2, color="tab:red", linestyle=":", label="GRPO clip 0.2")
        axes[0, 1].set(xscale="log", xlabel="|token log-prob difference| trainer vs old, first mini-batch",
                       ylabel="sampled tokens", title="Token-level mismatch (GRPO's log ratio before any update)")
        engines = cfg["engines"]
        width = 0.8 / (len(cfg["methods"]) * len(cfg["lengths"]))
        for i, length in enumerate(cfg["lengths"]):
            for k, method in enumerate(cfg["methods"]):
                offset = (i * len(cfg["methods"]) + k) * width - 0.4 + width / 2
                entries = [summary["precision"]["arms"].get(f"{method} L{length} {e}", {}) for e in engines]
                ys = [max(1e-5, (e.get("clip_frac_first_minibatch") or {}).get("mean") or 0.0) for e in entries]
                axes[1, 0].bar(np.arange(len(engines)) + offset, ys, width, color=COLORS[method],
                               alpha=0.5 + 0.5 * i / max(1, len(cfg["lengths"]) - 1), label=f"{method} L{length}")
                ys = [(e.get("final_reward") or {}).get("mean") or 0.0 for e in entries]
                es = [(e.get("final_reward") or {}).get("ci95") or 0.0 for e in entries]
                axes[1, 1].bar(np.arange(len(engines)) + offset, ys, width, yerr=es, capsize=2, color=COLORS[method],
                               alpha=0.5 + 0.5 * i / max(1, len(cfg["lengths"]) - 1), label=f"{method} L{length}")
        axes[1, 0].set(yscale="log", ylabel="clip fraction, first mini-batch (GSPO: seqs, GRPO: tokens)",
                       title="Clipping before any update (pure mismatch)")
        axes[1, 1].set(ylabel="training reward, last 10% of steps", title="Final reward (95% CI)")
        for ax in axes[1]:
            ax.set_xticks(np.arange(len(engines)), engines, fontsize=8, rotation=15)
        for ax in axes.flat:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        save(fig, "precision.png")
    return paths


# -- stamp, curves, main ---------------------------------------------------------------------
def stamp(argv: list[str]) -> dict:
    import lightning
    import torch
    import transformers

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.rstrip()
        except (OSError, subprocess.CalledProcessError):
            return None

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty_tracked_files": sorted(line[3:] for line in dirty.splitlines()) if dirty else [],
        "command": " ".join(["python", "experiments/paper_in_miniature.py", *argv]),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "lightning": lightning.__version__},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_at_start": [round(x, 2) for x in os.getloadavg()]},
    }


def _compact(results: list[dict]) -> dict:
    keep = ["reward/mean", "loss/clip_frac", "loss/clip_frac_tokens", "loss/clip_frac_first_minibatch",
            "moe/routing_change", "loss/ratio_max", "loss/ratio_min", "response/length_mean", "engine/logprob_abs_diff",
            "grad_norm", "skipped_updates", "probe/token_abs_diff_max"]
    out: dict[str, Any] = {}
    for r in results:
        key = f"{r['experiment']}/{r['arm']}/seed{r['seed']}"
        out[key] = {"run": {k: v for k, v in r.items() if k not in ("history", "mismatch")},
                    "history": {name: [None if v is None else float(f"{v:.3g}") for v in r["history"][name]]
                                for name in keep if any(v is not None for v in r["history"][name])}}
    return out


def _from_files(out: Path) -> list[dict]:
    curves = json.loads((out / "curves.json").read_text())
    with gzip.open(out / "mismatch.json.gz", "rt") as handle:
        mismatch = json.load(handle)
    results = []
    for key, value in curves.items():
        history = {name: value["history"].get(name, [None] * len(value["history"]["reward/mean"])) for name in METRICS}
        results.append({**value["run"], "history": history, "mismatch": mismatch.get(key, {"seq": [], "tokens": []})})
    return results


def build_setup(smoke: bool, seeds: Optional[list[int]], steps: Optional[int], experiments: list[str]) -> dict:
    setup = json.loads(json.dumps(SETUP))
    setup["experiments"] = {k: v for k, v in setup["experiments"].items() if k in experiments}
    for name, cfg in setup["experiments"].items():
        if smoke:
            cfg.update(json.loads(json.dumps(SMOKE[name])))
        if seeds:
            cfg["seeds"] = seeds
        if steps:
            cfg["steps"] = steps
    return setup


def write_readme(summary: dict, out: Path) -> Path:
    """README.md with the tables and the verdicts (experiments/results_readme.py)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # results_readme.py sits next to this script
        sys.path.insert(0, here)
    import results_readme

    return results_readme.write(summary, out)


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"), help="output folder")
    parser.add_argument("--smoke", action="store_true", help="every experiment, 1-2 seeds, 2 steps: seconds")
    parser.add_argument("--experiments", nargs="*", choices=list(SETUP["experiments"]), default=list(SETUP["experiments"]))
    parser.add_argument("--seeds", type=int, nargs="*", help="override the seeds of every experiment")
    parser.add_argument("--steps", type=int, help="override the rollout steps of every experiment")
    parser.add_argument("--set", nargs="*", default=[], metavar="EXP.KEY=JSON",
                        help="override one setting of an experiment, e.g. moe.lr=0.003 (for exploration; the README's "
                             "numbers use none)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="runs in parallel (processes, one thread each; default: 2 or the CPU count)")
    parser.add_argument("--replot", action="store_true", help="redraw the plots from the files in --out; train nothing")
    parser.add_argument("--smooth", type=int, help=f"moving-average window of the curves (default {SMOOTH}, smoke 1)")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        summary = json.loads((out / "summary.json").read_text())
        results = _from_files(out)
        paths = plot(results, summary["results"], summary["setup"], out, args.smooth or SMOOTH)
        paths.append(write_readme(summary, out))
        print(f"redrew {', '.join(p.name for p in paths)} in {out}")
        return summary

    setup = build_setup(args.smoke, args.seeds, args.steps, args.experiments)
    for item in args.set:
        key, _, value = item.partition("=")
        exp, _, name = key.partition(".")
        if exp not in setup["experiments"] or not name:
            parser.error(f"--set {item}: expected EXP.KEY=JSON with EXP one of {list(setup['experiments'])}")
        setup["experiments"][exp][name] = json.loads(value)
    smooth = args.smooth if args.smooth is not None else (1 if args.smoke else SMOOTH)
    info = stamp(argv)
    runs = sorted(plan(setup), key=cost, reverse=True)  # longest first: the pool packs better
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="paper_in_miniature-") as work_dir:
        jobs = [(run, work_dir) for run in runs]
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
    order = {key: i for i, key in enumerate((r["experiment"], r["arm"], r["seed"]) for r in plan(setup))}
    results.sort(key=lambda r: order[(r["experiment"], r["arm"], r["seed"])])

    info["wall_seconds"] = round(seconds, 1)
    info["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    info["seeds"] = {name: cfg["seeds"] for name, cfg in setup["experiments"].items()}
    info["jobs"] = args.jobs
    summary = {
        "stamp": info,
        "setup": {**setup, "models": MODELS, "methods": METHODS, "engines": ENGINES, "heldout_prompts": HELDOUT_PROMPTS},
        "definitions": DEFINITIONS,
        "results": summarize(results, setup),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "curves.json").write_text(json.dumps(_compact(results), separators=(",", ":")) + "\n")
    mismatch = {f"{r['experiment']}/{r['arm']}/seed{r['seed']}": r["mismatch"] for r in results if r["experiment"] == "precision"}
    with gzip.open(out / "mismatch.json.gz", "wt") as handle:
        handle.write(json.dumps(mismatch, separators=(",", ":")) + "\n")
    paths = plot(results, summary["results"], setup, out, smooth)
    paths.append(write_readme(summary, out))
    print(f"wrote summary.json, curves.json, mismatch.json.gz, {', '.join(p.name for p in paths)} to {out} in {seconds:.0f} s")
    print_summary(summary["results"])
    return summary


DEFINITIONS = {
    "mean/ci95": "mean over seeds of a per-seed value, and the half-width of its 95% Student-t interval",
    "final_reward": "training reward (sampled, temperature 1) averaged over the last 10% of rollout steps",
    "heldout_reward": "greedy responses of the trained fp32 policy to the 20 held-out digit pairs (never trained on), "
                      "scored by the task reward; heldout_accuracy: share answered exactly",
    "clip_frac": "share where the clip is active, mean over rollout steps: sequences for GSPO, tokens for GRPO",
    "clip_frac_tokens": "the same counted in tokens (GSPO: every token of a clipped sequence), all steps; "
                        "clip_frac_tokens_late: second half of the steps",
    "clip_frac_first_minibatch": "clip fraction of the first mini-batch of each rollout, before any update: "
                                 "nonzero only when pi_old differs from the trainer (engine log-probs)",
    "ratio (length / lr tables)": "GSPO clip_frac_tokens / GRPO clip_frac_tokens per seed (same initial weights), "
                                  "geometric mean and 95% interval over seeds",
    "routing_change": "share of (valid token, MoE layer) whose top-k expert set differs from pi_old's, mean over the "
                      "training forwards after the first update of each rollout (GRPO+RR: would have changed)",
    "first_minibatch_mismatch": "trainer minus pi_old log-probs in the first mini-batch of each rollout: |per-sequence "
                                "mean| (the GSPO log ratio) and |per-token| (GRPO) quantiles, shares beyond each clip",
    "engine_logprob_abs_diff": "mean |trainer - engine| sampled-token log-prob, first mini-batch (logged by the module)",
    "drop_from_best": f"best {SMOOTH}-step moving average of the training reward minus final_reward",
    "collapsed_seeds": f"seeds whose drop_from_best exceeds {COLLAPSE_DROP} or whose run stopped on a non-finite loss",
    "comparisons": "a - b of final_reward / heldout_reward, seed by seed (same initial weights and prompts): mean "
                   "and 95% interval; the difference is significant when the interval excludes 0",
    "log_ratio_min": "log of the smallest importance ratio in a step, mean over steps",
}


def print_summary(results: dict) -> None:
    for exp, block in results.items():
        for arm, e in block["arms"].items():
            fr, ho = e.get("final_reward", {}), e.get("heldout_reward", {})
            ct = e.get("clip_frac_tokens", {})
            extra = ""
            if e.get("routing_change"):
                extra += f" routing {e['routing_change']['mean']:.3f}"
            if e.get("first_minibatch_mismatch"):
                extra += f" mismatch seq p50 {e['first_minibatch_mismatch']['seq_abs_log_ratio'].get('p50')}"
            if e.get("clip_frac_first_minibatch"):
                extra += f" clip1st {e['clip_frac_first_minibatch']['mean']:.3g}"
            print(f"  {exp:9s} {arm:26s} reward {fr.get('mean')} ± {fr.get('ci95')}  held-out {ho.get('mean')} ± "
                  f"{ho.get('ci95')}  clip tokens {ct.get('mean')}{extra}" + (f"  FAILURES {e['failures']}" if e["failures"] else ""))
        for row in block.get("by_length", []):
            print(f"  length {row['length']:4d}: GSPO {row['gspo_tokens']['mean']} GRPO {row['grpo_tokens']['mean']} "
                  f"ratio {row['ratio']['geo_mean']} (second half {row['ratio_second_half']['geo_mean']})")
        for row in block.get("by_lr", []):
            print(f"  lr {row['lr']:g}: GSPO {row['gspo_tokens']['mean']} GRPO {row['grpo_tokens']['mean']} "
                  f"ratio {row['ratio']['geo_mean']}")


def _report(result: dict, done: int, total: int, start: float) -> None:
    reward = [v for v in result["history"]["reward/mean"] if v is not None]
    tail = reward[-max(1, len(reward) // 10):] or [float("nan")]
    held = result["heldout"]["reward"] if result.get("heldout") else float("nan")
    print(f"[{done}/{total} {time.perf_counter() - start:5.0f} s] {result['experiment']} {result['arm']} seed "
          f"{result['seed']}: final reward {sum(tail) / len(tail):.3f}, held-out {held:.3f} ({result['seconds']:.0f} s)"
          + (f" FAILED {result['failure'][:80]}" if result.get("failure") else ""), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
