"""docs/results/README.md is generated from summary.json: the verdict rules decide from the
numbers (hand-made summaries here), and hand-written notes survive a regeneration."""

import pytest

from tests.helpers import load_script


@pytest.fixture(scope="module")
def readme():
    return load_script("experiments/results_readme.py")


def diff(mean, half):
    return {"mean": mean, "ci95": half, "n": 5}


def pair(a, b, final, held):
    return {"a": a, "b": b, "final_reward": final, "heldout_reward": held}


def arm(collapsed=0, **extra):
    return {"seeds": [0, 1, 2, 3, 4], "collapsed_seeds": collapsed, "final_reward": diff(0.5, 0.05),
            "heldout_reward": diff(0.4, 0.05), "clip_frac": diff(0.1, 0.01), **extra}


def length_row(length, ratio, low, high):
    return {"length": length, "gspo_tokens": diff(0.1, 0.01), "grpo_tokens": diff(0.1 / ratio, 0.001),
            "ratio": {"geo_mean": ratio, "ci95_low": low, "ci95_high": high},
            "ratio_second_half": {"geo_mean": ratio}}


def summary(ratios=((16, 3.0, 2.0, 4.0), (256, 12.0, 9.0, 15.0)), dense=(diff(0.01, 0.05), diff(0.02, 0.05)),
            replay=(diff(0.0, 0.05), diff(0.0, 0.05)), grpo_collapsed=0, precision_hurt=None):
    rows = [length_row(*r) for r in ratios]
    length_arms = {f"{m} L{r[0]}": arm() for r in ratios for m in ("GSPO", "GRPO")}
    zero = (diff(0.0, 0.05), diff(0.0, 0.05))
    precision_pairs = []
    for method in ("GSPO", "GRPO"):
        for engine in ("bf16 engine", "fp16 engine"):
            hurt = precision_hurt == (method, engine)
            precision_pairs.append(pair(f"{method} L8 {engine}", f"{method} L8 fp32 recompute",
                                        diff(-0.1, 0.03) if hurt else diff(0.0, 0.03), diff(0.0, 0.03)))
    precision_arms = {p["a"]: arm(first_minibatch_mismatch={
        "seq_abs_log_ratio": {"p50": 1e-4, "p99": 1e-3}, "token_abs_diff": {"p50": 1e-3, "p99": 1e-2},
        "share_seq_beyond_gspo_clip": 0.3, "share_tokens_beyond_grpo_clip": 0.0}) for p in precision_pairs}
    return {
        "stamp": {"commit": "a" * 40, "dirty_tracked_files": [], "command": "python experiments/paper_in_miniature.py",
                  "jobs": 2, "wall_seconds": 3600, "machine": {"cpus": 2, "load_average_at_start": [0.0, 0.0, 0.0]},
                  "versions": {"torch": "x"}, "seeds": {"dense": [0, 1, 2, 3, 4]}},
        "setup": {"group_size": 8, "models": {"moe": "builtin:tiny-moe16-echo"}, "experiments": {
            "length": {"lr": 3e-3, "prompts": 8, "mini_batches": 4, "steps": 20, "seeds": [0, 1, 2]},
            "dense": {"length": 8, "lr": 3e-3, "prompts": 16, "mini_batches": 4, "steps": 100},
            "moe": {"length": 8, "lr": 1e-2, "prompts": 16, "mini_batches": 8, "steps": 100},
            "precision": {"lengths": [8], "lr": 3e-3, "steps": 50}}},
        "results": {
            "length": {"arms": length_arms, "by_length": rows},
            "dense": {"arms": {"GSPO": arm(), "GRPO": arm(collapsed=grpo_collapsed)},
                      "comparisons": [pair("GSPO", "GRPO", *dense)]},
            "moe": {"arms": {"GSPO": arm(), "GRPO": arm(), "GRPO+RR": arm(routing_change=diff(0.1, 0.01))},
                    "comparisons": [pair("GSPO", "GRPO", *zero), pair("GRPO+RR", "GRPO", *replay),
                                    pair("GSPO", "GRPO+RR", *zero)]},
            "precision": {"arms": precision_arms, "comparisons": precision_pairs},
        },
    }


def test_significance_needs_the_whole_interval_on_one_side(readme):
    assert readme.significance(diff(0.1, 0.05)) == 1
    assert readme.significance(diff(-0.1, 0.05)) == -1
    assert readme.significance(diff(0.04, 0.05)) == 0
    assert readme.significance({"mean": 0.3, "ci95": None, "n": 1}) == 0  # one seed decides nothing


def test_clip_verdict_follows_the_ratio_and_its_growth(readme):
    assert readme.verdict_clip(summary()["results"])[0] == "partly"  # 3x -> 12x, all above 1
    grown = summary(ratios=((16, 5.0, 3.0, 8.0), (256, 80.0, 60.0, 100.0)))
    assert readme.verdict_clip(grown["results"])[0] == "reproduced"
    shrinking = summary(ratios=((16, 80.0, 60.0, 100.0), (256, 5.0, 3.0, 8.0)))  # large but not growing
    assert readme.verdict_clip(shrinking["results"])[0] == "partly"
    straddling = summary(ratios=((16, 1.5, 0.8, 2.5), (256, 4.0, 2.0, 6.0)))
    assert readme.verdict_clip(straddling["results"])[0] == "not reproduced"


def test_efficiency_moe_stability_and_precision_verdicts(readme):
    assert readme.verdict_efficiency(summary()["results"])[0] == "partly"
    assert readme.verdict_efficiency(summary(dense=(diff(0.1, 0.05), diff(0.0, 0.05)))["results"])[0] == "reproduced"
    assert readme.verdict_efficiency(summary(dense=(diff(0.1, 0.05), diff(-0.1, 0.05)))["results"])[0] == "not reproduced"

    assert readme.verdict_moe(summary()["results"])[0] == "not reproduced"
    assert readme.verdict_moe(summary(replay=(diff(0.0, 0.05), diff(0.2, 0.05)))["results"])[0] == "reproduced"

    assert readme.verdict_stability(summary()["results"])[0] == "not reproduced"
    assert readme.verdict_stability(summary(grpo_collapsed=1)["results"])[0] == "partly"
    assert readme.verdict_stability(summary(grpo_collapsed=2)["results"])[0] == "reproduced"

    assert readme.verdict_precision(summary()["results"])[0] == "partly"
    hurts_grpo = summary(precision_hurt=("GRPO", "bf16 engine"))
    verdict, why = readme.verdict_precision(hurts_grpo["results"])
    assert verdict == "reproduced" and "GRPO: L8 bf16 engine" in why
    assert readme.verdict_precision(summary(precision_hurt=("GSPO", "fp16 engine"))["results"])[0] == "not reproduced"


def test_readme_carries_stamp_verdicts_and_keeps_notes(readme, tmp_path):
    path = readme.write(summary(), tmp_path)
    text = path.read_text()
    assert "a" * 40 in text and "| 1a. GSPO clips ~100x more tokens than GRPO | **partly** |" in text
    assert "| 256 |" in text and "**12.0x** (9.0-15.0)" in text
    assert "| GRPO+RR - GRPO |" in text and "| GSPO L8 bf16 engine |" in text
    path.write_text(text + "Why the MoE did not collapse: two layers.\n")
    readme.write(summary(grpo_collapsed=2), tmp_path)
    again = path.read_text()
    assert again.endswith(readme.NOTES_MARKER + "\nWhy the MoE did not collapse: two layers.\n")
    assert "| 3. GSPO stable where GRPO collapses | **reproduced** |" in again
