"""docs/results/README.md from summary.json: the stamp, one table per experiment, and a verdict
per claim of the paper decided by the fixed rules below (``VERDICT_RULES``), so the text cannot
drift from the numbers. Text under ``NOTES_MARKER`` in an existing README (hand-written
reading of the results) is kept when the file is regenerated.

    python experiments/results_readme.py docs/results      # rewrite README.md from summary.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

NOTES_MARKER = "<!-- hand-written notes below: kept when this file is regenerated -->"
PAPER_CLIP_RATIO = 100  # "two orders of magnitude" more clipped tokens (paper, section 5.1)
REPRODUCED_CLIP_RATIO = 50  # within a factor 2 of the paper

VERDICT_RULES = f"""\
A difference is *significant* when its 95% interval over the paired seeds excludes 0.

| claim | reproduced | partly | not reproduced |
|---|---|---|---|
| 1a. GSPO clips about {PAPER_CLIP_RATIO}x more tokens than GRPO | the GSPO / GRPO ratio reaches {REPRODUCED_CLIP_RATIO}x at some length and grows with length | GSPO clips significantly more at every length, less than {REPRODUCED_CLIP_RATIO}x | otherwise |
| 1b. ... and still trains more efficiently (equal compute, dense) | GSPO - GRPO significantly > 0 on held-out or training reward | neither significantly different from 0 (as efficient) | GSPO significantly worse on either |
| 2. MoE: GRPO needs Routing Replay, GSPO does not | replay significantly helps GRPO and GSPO is not significantly worse than GRPO+RR | one of the two holds, or GSPO significantly beats GRPO without replay | neither |
| 3. GSPO stays stable where GRPO collapses (MoE and dense) | GRPO collapses in >= 2 seeds of an experiment where GSPO collapses in none | GRPO collapses in more seeds than GSPO | otherwise |
| 4. sequence ratios tolerate engine / trainer precision gaps (engine log-probs as pi_old) | no engine arm significantly hurts GSPO, and some engine arm significantly hurts GRPO | no engine arm significantly hurts either (GSPO tolerant, no edge shown) | some engine arm significantly hurts GSPO while GRPO is not hurt by it |
"""


def fmt(entry: Optional[dict], digits: int = 3) -> str:
    """``mean ± ci95`` of a summary entry."""
    if not entry or entry.get("mean") is None:
        return "-"
    if entry.get("ci95") is None:
        return f"{entry['mean']:.{digits}f}"
    return f"{entry['mean']:.{digits}f} ± {entry['ci95']:.{digits}f}"


def fmt_g(entry: Optional[dict]) -> str:
    if not entry or entry.get("mean") is None:
        return "-"
    return f"{entry['mean']:.3g}" + (f" ± {entry['ci95']:.2g}" if entry.get("ci95") is not None else "")


def significance(diff: dict) -> int:
    """+1 / -1 when the 95% interval lies above / below 0, else 0."""
    if not diff or diff.get("mean") is None or diff.get("ci95") is None:
        return 0
    if diff["mean"] - diff["ci95"] > 0:
        return 1
    if diff["mean"] + diff["ci95"] < 0:
        return -1
    return 0


def _comparison(block: dict, a: str, b: str) -> Optional[dict]:
    return next((c for c in block.get("comparisons", []) if c["a"] == a and c["b"] == b), None)


def _diff_cell(c: Optional[dict], key: str) -> str:
    if not c:
        return "-"
    mark = {1: " (+, significant)", -1: " (-, significant)", 0: ""}[significance(c[key])]
    return f"{c[key]['mean']:+.3f} ± {c[key]['ci95'] or 0:.3f}{mark}" if c[key].get("mean") is not None else "-"


# -- the verdicts ---------------------------------------------------------------------------
def verdict_clip(results: dict) -> tuple[str, str]:
    rows = results.get("length", {}).get("by_length", [])
    if not rows:
        return "not run", ""
    ratios = [r["ratio"].get("geo_mean") or 0.0 for r in rows]
    lows = [r["ratio"].get("ci95_low") for r in rows]
    grows = ratios[-1] > ratios[0]
    why = (f"GSPO / GRPO clipped-token ratio {ratios[0]:.1f}x at {rows[0]['length']} tokens -> {ratios[-1]:.1f}x at "
           f"{rows[-1]['length']} tokens (max {max(ratios):.1f}x)")
    if max(ratios) >= REPRODUCED_CLIP_RATIO and grows:
        return "reproduced", why
    if all(low is not None and low > 1 for low in lows):
        return "partly", why + f"; significantly above 1 at every length, below {REPRODUCED_CLIP_RATIO}x"
    return "not reproduced", why


def verdict_efficiency(results: dict) -> tuple[str, str]:
    c = _comparison(results.get("dense", {}), "GSPO", "GRPO")
    if not c:
        return "not run", ""
    held, final = significance(c["heldout_reward"]), significance(c["final_reward"])
    why = f"GSPO - GRPO: held-out {_diff_cell(c, 'heldout_reward')}, training {_diff_cell(c, 'final_reward')}"
    if -1 in (held, final):
        return "not reproduced", why
    if 1 in (held, final):
        return "reproduced", why
    return "partly", why + " (as efficient, not shown more efficient)"


def verdict_moe(results: dict) -> tuple[str, str]:
    block = results.get("moe", {})
    rr, gspo_rr, gspo_grpo = (_comparison(block, "GRPO+RR", "GRPO"), _comparison(block, "GSPO", "GRPO+RR"),
                              _comparison(block, "GSPO", "GRPO"))
    if not (rr and gspo_rr and gspo_grpo):
        return "not run", ""

    def best(c):  # the significant sign on held-out, else on training reward
        return significance(c["heldout_reward"]) or significance(c["final_reward"])

    replay_helps, gspo_not_worse, gspo_beats_grpo = best(rr) > 0, best(gspo_rr) >= 0, best(gspo_grpo) > 0
    why = (f"GRPO+RR - GRPO held-out {_diff_cell(rr, 'heldout_reward')}; GSPO - GRPO+RR held-out "
           f"{_diff_cell(gspo_rr, 'heldout_reward')}; GSPO - GRPO held-out {_diff_cell(gspo_grpo, 'heldout_reward')}")
    if replay_helps and gspo_not_worse:
        return "reproduced", why
    if replay_helps or gspo_beats_grpo or (gspo_not_worse and best(gspo_rr) > 0):
        return "partly", why
    return "not reproduced", why


def verdict_stability(results: dict) -> tuple[str, str]:
    counts = {exp: {arm: e.get("collapsed_seeds", 0) for arm, e in results[exp]["arms"].items()}
              for exp in ("dense", "moe") if exp in results}
    if not counts:
        return "not run", ""
    why = "; ".join(f"{exp}: " + ", ".join(f"{arm} {n}/{len(results[exp]['arms'][arm]['seeds'])}" for arm, n in c.items())
                    for exp, c in counts.items()) + " seeds collapsed"
    if any(c.get("GRPO", 0) >= 2 and c.get("GSPO", 0) == 0 for c in counts.values()):
        return "reproduced", why
    if any(c.get("GRPO", 0) > c.get("GSPO", 0) for c in counts.values()):
        return "partly", why
    return "not reproduced", why


def verdict_precision(results: dict) -> tuple[str, str]:
    block = results.get("precision")
    if not block:
        return "not run", ""
    hurt = {"GSPO": [], "GRPO": []}
    for c in block["comparisons"]:
        method = c["a"].split()[0]
        if significance(c["final_reward"]) < 0 or significance(c["heldout_reward"]) < 0:
            hurt[method].append(c["a"].split(" ", 1)[1])
    why = (f"engine arms that significantly hurt GSPO: {', '.join(hurt['GSPO']) or 'none'}; "
           f"GRPO: {', '.join(hurt['GRPO']) or 'none'}")
    gspo_only = [arm for arm in hurt["GSPO"] if arm not in hurt["GRPO"]]
    if not hurt["GSPO"] and hurt["GRPO"]:
        return "reproduced", why
    if not hurt["GSPO"] and not hurt["GRPO"]:
        return "partly", why
    if gspo_only:
        return "not reproduced", why
    return "partly", why + " (both hurt by the same arms)"


# -- the tables -------------------------------------------------------------------------------
def length_tables(block: dict) -> list[str]:
    lines = ["| response tokens | GSPO clipped tokens | GRPO clipped tokens | GSPO / GRPO (95% interval) | "
             "second half | training reward GSPO / GRPO |", "|---|---|---|---|---|---|"]
    for row in block.get("by_length", []):
        r, late = row["ratio"], row["ratio_second_half"]
        gspo, grpo = block["arms"][f"GSPO L{row['length']}"], block["arms"][f"GRPO L{row['length']}"]
        lines.append(f"| {row['length']} | {fmt_g(row['gspo_tokens'])} | {fmt_g(row['grpo_tokens'])} | "
                     f"**{r.get('geo_mean')}x** ({r.get('ci95_low')}-{r.get('ci95_high')}) | {late.get('geo_mean')}x | "
                     f"{fmt(gspo.get('final_reward'))} / {fmt(grpo.get('final_reward'))} |")
    if block.get("by_lr"):
        lines += ["", "| learning rate (length " + str(block["by_lr"][0]["length"]) + ") | GSPO clipped tokens | "
                  "GRPO clipped tokens | GSPO / GRPO (95% interval) |", "|---|---|---|---|"]
        for row in block["by_lr"]:
            r = row["ratio"]
            lines.append(f"| {row['lr']:g} | {fmt_g(row['gspo_tokens'])} | {fmt_g(row['grpo_tokens'])} | "
                         f"**{r.get('geo_mean')}x** ({r.get('ci95_low')}-{r.get('ci95_high')}) |")
    return lines


def method_table(block: dict, routing: bool) -> list[str]:
    head = "| method | training reward | held-out reward | held-out exact | clip fraction | collapsed seeds |"
    sep = "|---|---|---|---|---|---|"
    if routing:
        head, sep = head + " routing change |", sep + "---|"
    lines = [head, sep]
    for arm, e in block["arms"].items():
        unit = "seq" if arm == "GSPO" else "tok"
        line = (f"| {arm} | {fmt(e.get('final_reward'))} | {fmt(e.get('heldout_reward'))} | "
                f"{fmt(e.get('heldout_accuracy'), 2)} | {fmt_g(e.get('clip_frac'))} ({unit}) | "
                f"{e.get('collapsed_seeds', 0)}/{len(e['seeds'])} |")
        if routing:
            line += f" {fmt(e.get('routing_change'))} |"
        lines.append(line)
    lines += ["", "| a - b (paired seeds) | training reward | held-out reward |", "|---|---|---|"]
    for c in block.get("comparisons", []):
        lines.append(f"| {c['a']} - {c['b']} | {_diff_cell(c, 'final_reward')} | {_diff_cell(c, 'heldout_reward')} |")
    return lines


def precision_table(block: dict) -> list[str]:
    lines = ["| arm | mismatch: \\|seq log ratio\\| p50 / p99 | \\|token diff\\| p50 / p99 | seqs beyond 3e-4 | "
             "tokens beyond 0.2 | clip fraction, 1st mini-batch | training reward | vs fp32 recompute (paired) |",
             "|---|---|---|---|---|---|---|---|"]
    by_arm = {c["a"]: c for c in block["comparisons"]}
    for arm, e in block["arms"].items():
        m = e.get("first_minibatch_mismatch", {})
        seq, tok = m.get("seq_abs_log_ratio", {}), m.get("token_abs_diff", {})
        lines.append(f"| {arm} | {seq.get('p50', '-'):.3g} / {seq.get('p99', 0):.3g} | {tok.get('p50', 0):.3g} / "
                     f"{tok.get('p99', 0):.3g} | {m.get('share_seq_beyond_gspo_clip', '-')} | "
                     f"{m.get('share_tokens_beyond_grpo_clip', '-')} | {fmt_g(e.get('clip_frac_first_minibatch'))} | "
                     f"{fmt(e.get('final_reward'))} | {_diff_cell(by_arm.get(arm), 'final_reward')} |"
                     if seq else f"| {arm} | - | - | - | - | - | {fmt(e.get('final_reward'))} | - |")
    return lines


# -- the file -----------------------------------------------------------------------------------
def render(summary: dict, notes: str = "") -> str:
    stamp, setup, results = summary["stamp"], summary["setup"], summary["results"]
    exps = setup["experiments"]
    dirty = ", ".join(stamp["dirty_tracked_files"]) or "none"
    verdicts = [("1a. GSPO clips ~100x more tokens than GRPO", verdict_clip(results)),
                ("1b. ... and trains at least as efficiently", verdict_efficiency(results)),
                ("2. MoE: GRPO needs Routing Replay, GSPO does not", verdict_moe(results)),
                ("3. GSPO stable where GRPO collapses", verdict_stability(results)),
                ("4. sequence ratios tolerate engine precision gaps", verdict_precision(results))]
    out = [
        "# The GSPO paper in miniature",
        "",
        "Generated by `python experiments/paper_in_miniature.py --out docs/results` (this file: "
        "`experiments/results_readme.py` from `summary.json`; do not edit above the notes marker).",
        "",
        f"- commit `{stamp['commit']}` (tracked files changed at the time: {dirty})",
        f"- command `{stamp['command']}`, {stamp.get('jobs', 1)} jobs, wall time {stamp.get('wall_seconds', 0) / 60:.0f} min",
        f"- {stamp['machine']['cpus']} CPUs, load average at start {stamp['machine']['load_average_at_start']}; "
        + ", ".join(f"{k} {v}" for k, v in stamp["versions"].items()),
        f"- seeds: " + ", ".join(f"{k} {v}" for k, v in stamp.get("seeds", {}).items()),
        "",
        "Tiny models trained from random weights by RL alone on the `pattern` task (prompt `repeat 3 7`, answer "
        "`3 7 3 7 ...`, reward = share of positions right; 20 digit pairs held out and scored greedily after "
        "training). Every arm of an experiment has the same compute. Numbers are means over seeds with 95% "
        "intervals; method pairs are compared seed by seed.",
        "",
        "## Verdicts",
        "",
        "| claim | verdict | numbers |",
        "|---|---|---|",
        *[f"| {claim} | **{v}** | {why} |" for claim, (v, why) in verdicts],
        "",
        "How the verdicts are decided (`experiments/results_readme.py`, fixed before the run):",
        "",
        VERDICT_RULES,
    ]
    if "length" in results:
        cfg = exps["length"]
        out += ["## 1a. Clipping as responses grow", "",
                f"Dense model, lr {cfg['lr']:g}, {cfg['prompts']} prompts x {setup['group_size']} responses, "
                f"{cfg['mini_batches']} mini-batches per rollout, {cfg['steps']} rollouts, seeds {cfg['seeds']}. "
                "Clipped tokens: share of response tokens in the clipped branch (GSPO: every token of a clipped "
                "sequence). Plot: `clip_vs_length.png`.", "", *length_tables(results["length"]), ""]
    if "dense" in results:
        cfg = exps["dense"]
        out += ["## 1b. Equal compute, dense", "",
                f"Response length {cfg['length']}, lr {cfg['lr']:g}, {cfg['prompts']} prompts x {setup['group_size']}, "
                f"{cfg['mini_batches']} mini-batches, {cfg['steps']} rollouts. Plots: `reward_curves.png`, "
                "`final_rewards.png`.", "", *method_table(results["dense"], routing=False), ""]
    if "moe" in results:
        cfg = exps["moe"]
        out += ["## 2-3. MoE with routing drift", "",
                f"`{setup['models']['moe']}` (16 experts, top-2), response length {cfg['length']}, lr {cfg['lr']:g}, "
                f"{cfg['mini_batches']} mini-batches per rollout, router aux-loss coefficient "
                f"{cfg.get('router_aux_loss_coef', 0)}, {cfg['steps']} rollouts. Routing change: share of (token, "
                "layer) whose top-2 set differs from pi_old's (GRPO+RR: would differ).", "",
                *method_table(results["moe"], routing=True), ""]
    if "precision" in results:
        cfg = exps["precision"]
        out += ["## 4. Engine precision", "",
                f"Rollouts and pi_old log-probs from a lower-precision copy of the policy (`HFCopyEngine`), trainer "
                f"in fp32, `old_logprobs=engine`; lengths {cfg['lengths']}, lr {cfg['lr']:g}, {cfg['steps']} rollouts. "
                "Mismatch: trainer minus pi_old in the first mini-batch of each rollout, before any update. "
                "Plot: `precision.png`.", "", *precision_table(results["precision"]), ""]
    out += ["## Reproduce", "", "```bash", "python experiments/paper_in_miniature.py --out docs/results   # full run",
            "python experiments/paper_in_miniature.py --smoke --out /tmp/smoke   # seconds; also in the test suite",
            "python experiments/paper_in_miniature.py --replot --out docs/results  # plots and this file from the JSON",
            "```", "", NOTES_MARKER, ""]
    return "\n".join(out) + (notes.lstrip("\n") if notes else "")


def write(summary: dict, out_dir: Path) -> Path:
    """(Re)write ``out_dir/README.md``, keeping the notes under :data:`NOTES_MARKER`."""
    path = Path(out_dir) / "README.md"
    notes = ""
    if path.is_file():
        _, marker, tail = path.read_text().partition(NOTES_MARKER)
        notes = tail if marker else ""
    path.write_text(render(summary, notes))
    return path


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results")
    print(write(json.loads((folder / "summary.json").read_text()), folder))
