"""experiments/paper_in_miniature.py --smoke: the whole pipeline, tiny, into a tmp dir."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "paper_in_miniature.py"


@pytest.mark.slow
def test_smoke_run_writes_summary_and_plots(tmp_path):
    spec = importlib.util.spec_from_file_location("paper_in_miniature", SCRIPT)
    experiment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(experiment)
    summary = experiment.main(["--smoke", "--jobs", "1", "--out", str(tmp_path)])

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["results"] == json.loads(json.dumps(summary["results"]))
    assert set(on_disk["results"]) == {"standard", "stress"}
    for regime, models in on_disk["results"].items():
        assert set(models) == {"dense", "moe"}
        assert set(models["dense"]) == {"GSPO", "GRPO"}
        assert set(models["moe"]) == {"GSPO", "GRPO", "GRPO+RR"}
        for model, methods in models.items():
            for method, entry in methods.items():
                for key in ("final_reward_mean", "final_reward_std", "mean_clip_frac", "mean_clip_frac_tokens",
                            "clip_frac_unit", "final_kl_to_init", "optimizer_steps"):
                    assert entry[key] is not None, (regime, model, method, key)
                assert 0.0 <= entry["final_reward_mean"] <= 1.0
                # equal compute: 4 optimizer steps per rollout for every method
                assert entry["optimizer_steps"] == 4 * on_disk["setup"]["regimes"][regime]["rollout_steps"]
                assert entry["clip_frac_unit"] == ("sequences" if method == "GSPO" else "tokens")
            for method in ("GSPO", "GRPO", "GRPO+RR"):
                assert 0.0 <= models["moe"][method]["mean_routing_change"] <= 1.0
    for name in ("reward_curves.png", "clip_fraction.png", "kl.png", "importance_ratios.png", "routing_change.png"):
        path = tmp_path / name
        assert path.is_file() and 1000 < path.stat().st_size < 300_000, name
    curves = json.loads((tmp_path / "curves.json").read_text())
    assert "stress/moe/GRPO+RR/seed0" in curves and "reward/mean" in curves["stress/moe/GRPO+RR/seed0"]

    # the plots can be redrawn from the saved curves alone
    (tmp_path / "reward_curves.png").unlink()
    experiment.main(["--replot", "--out", str(tmp_path)])
    assert (tmp_path / "reward_curves.png").is_file()
