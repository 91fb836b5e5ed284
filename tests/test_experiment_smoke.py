"""experiments/paper_in_miniature.py --smoke: every experiment of docs/results, tiny, into a
tmp dir, so that a change that breaks the experiment fails CI."""

import json

import pytest

from tests.helpers import load_script

PLOTS = ("clip_vs_length.png", "reward_curves.png", "final_rewards.png", "precision.png")


def load_experiment():
    return load_script("experiments/paper_in_miniature.py")


@pytest.mark.slow
def test_smoke_run_writes_stamped_summary_and_plots(tmp_path):
    experiment = load_experiment()
    summary = experiment.main(["--smoke", "--jobs", "1", "--out", str(tmp_path)])

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["results"] == json.loads(json.dumps(summary["results"]))
    stamp = on_disk["stamp"]
    assert len(stamp["commit"]) == 40 and isinstance(stamp["dirty_tracked_files"], list)
    assert stamp["command"].endswith(f"--smoke --jobs 1 --out {tmp_path}")
    assert set(stamp["versions"]) == {"python", "torch", "transformers", "lightning"}
    assert stamp["wall_seconds"] > 0 and stamp["seeds"]["dense"] == [0, 1]
    results = on_disk["results"]
    assert set(results) == {"length", "dense", "moe", "precision"}

    # equal compute: every arm of an experiment takes the same optimizer steps
    for exp, block in results.items():
        steps = {arm: e["optimizer_steps"] for arm, e in block["arms"].items()}
        cfg = on_disk["setup"]["experiments"][exp]
        assert set(steps.values()) == {cfg["steps"] * cfg["mini_batches"]}, (exp, steps)
        for arm, e in block["arms"].items():
            for name in ("final_reward", "heldout_reward"):  # the summary is the mean of its seeds
                per_seed = e[f"{name}_per_seed"]
                assert len(per_seed) == e[name]["n"] == len(e["seeds"]), (exp, arm, name)
                assert e[name]["mean"] == pytest.approx(sum(per_seed) / len(per_seed), abs=1e-4), (exp, arm, name)
            assert e["clip_frac_tokens"]["mean"] is not None and not e["failures"], (exp, arm)
    dense = results["dense"]["arms"]["GSPO"]
    assert dense["final_reward"]["n"] == 2 and dense["final_reward"]["ci95"] is not None  # a 95% interval over seeds

    # clip fraction by length and learning rate, as paired GSPO / GRPO ratios
    assert [row["length"] for row in results["length"]["by_length"]] == [8]
    assert len(results["length"]["by_lr"]) == 2 and results["length"]["by_length"][0]["ratio"]["geo_mean"] > 0

    # MoE: GSPO, GRPO and GRPO with Routing Replay; routing change measured for all three
    assert set(results["moe"]["arms"]) == {"GSPO", "GRPO", "GRPO+RR"}
    for e in results["moe"]["arms"].values():
        # a share of tokens whose experts changed after the first update: measured, so above 0
        assert 0.0 < e["routing_change"]["mean"] < 1.0

    # precision: engine log-probs as pi_old; the mismatch is measured, and zero with recompute
    precision = results["precision"]["arms"]
    assert set(precision) == {f"{m} L8 {e}" for m in ("GSPO", "GRPO")
                              for e in ("fp32 recompute", "bf16 engine", "bf16+fp8 recompute")}
    bf16 = precision["GSPO L8 bf16 engine"]
    assert bf16["first_minibatch_mismatch"]["seq_abs_log_ratio"]["p50"] > 1e-5
    assert precision["GSPO L8 fp32 recompute"]["first_minibatch_mismatch"]["seq_abs_log_ratio"]["max"] < 1e-5
    assert 0 < bf16["engine_logprob_abs_diff"]["mean"] < 0.1

    readme = (tmp_path / "README.md").read_text()  # tables and verdicts from the same summary
    assert stamp["commit"] in readme and "## Verdicts" in readme and "| GSPO L8 bf16 engine |" in readme

    for name in PLOTS:
        path = tmp_path / name
        assert path.is_file() and 1000 < path.stat().st_size < 400_000, name
    curves = json.loads((tmp_path / "curves.json").read_text())
    assert "moe/GRPO+RR/seed0" in curves and "reward/mean" in curves["moe/GRPO+RR/seed0"]["history"]

    # the plots can be redrawn from the saved files alone
    for name in PLOTS:
        (tmp_path / name).unlink()
    experiment.main(["--replot", "--out", str(tmp_path)])
    assert all((tmp_path / name).is_file() for name in PLOTS)


def test_plan_has_equal_compute_and_enough_seeds():
    """The full run's plan: >= 5 seeds where methods are compared on reward, one compute budget per experiment."""
    experiment = load_experiment()
    setup = experiment.build_setup(False, None, None, list(experiment.SETUP["experiments"]))
    runs = experiment.plan(setup)
    for exp in ("dense", "moe"):
        assert len(setup["experiments"][exp]["seeds"]) >= 5
    assert setup["experiments"]["length"]["lengths"][0] <= 16 and setup["experiments"]["length"]["lengths"][-1] >= 256
    for exp in setup["experiments"]:
        budgets = {(r["steps"], r["prompts"], r["group"], r["mini_batches"]) for r in runs if r["experiment"] == exp}
        assert len(budgets) == 1, (exp, budgets)
