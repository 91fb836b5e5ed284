"""experiments/dynamic_sampling.py: what it reads from a run folder and the tables it writes,
on hand-made logs (the real runs take minutes each: `--smoke` is run by hand, see its docstring)."""

import csv
import json

from tests.helpers import load_script


def fake_run(folder, steps, accuracy):
    logs = folder / "csv" / "version_0"
    logs.mkdir(parents=True)
    names = sorted({k for row in steps for k in row} | {"policy_version", "step"})
    with open(logs / "metrics.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, names)
        writer.writeheader()
        for i, row in enumerate(steps):
            writer.writerow({"policy_version": 2 * (i + 1), "step": i, **row})
            writer.writerow({"step": i})  # a validation row: no policy_version, skipped
    (logs / "history.json").write_text(json.dumps({"val/accuracy": accuracy}))


def test_runs_are_read_and_tabled_per_arm(tmp_path):
    experiment = load_script("experiments/dynamic_sampling.py")
    plain = {"reward/mean": 0.1, "reward/zero_std_groups": 0.75, "time/step": 10.0, "time/generate": 2.0}
    fake_run(tmp_path / "off", [plain, {**plain, "time/step": 30.0}], [[0, 0.04], [2, 0.10]])
    dynamic = {**plain, "reward/zero_std_groups": 0.0, "dynamic_sampling/zero_variance_share": 0.6,
               "dynamic_sampling/rounds": 3.0, "time/step": 20.0}
    fake_run(tmp_path / "on", [dynamic, dynamic], [[0, 0.04], [2, 0.30]])

    off = experiment.read_run(tmp_path / "off", {"wall_s": 120.0, "commit": "a" * 40})
    on = experiment.read_run(tmp_path / "on", {"wall_s": 60.0})
    # accuracy at each validation with the training seconds summed up to it
    assert off["val_accuracy"] == [{"step": 0, "accuracy": 0.04, "train_seconds": 0.0},
                                   {"step": 2, "accuracy": 0.10, "train_seconds": 40.0}]
    assert on["val_accuracy"][1] == {"step": 2, "accuracy": 0.30, "train_seconds": 40.0}
    # the share of generated groups: all rounds' with dynamic sampling, the trained batch's without
    assert [experiment.zero_variance(r) for r in off["steps"]] == [0.75, 0.75]
    assert [experiment.zero_variance(r) for r in on["steps"]] == [0.6, 0.6]

    summary = {"stamp": {"commit": "c" * 40, "dirty": [], "command": "python x", "load_at_start": [1.0], "cpus": 2},
               "runs": {"two_digit": {"off": off, "dynamic": on}}}
    text = experiment.readme(summary)
    assert "| off | 0.04 (0 s) | 0.10 (40 s) |" in text and "| dynamic | 0.04 (0 s) | 0.30 (40 s) |" in text
    assert "| dynamic: rounds | 3 | 3 | 3.00 |" in text and "| off: rounds | 1 | 1 | 1.00 |" in text
    assert "| off: s/step (generate) | 10 (2) | 30 (2) | 20 (2) |" in text
    assert "| dynamic: zero-variance share | 0.60 | 0.60 | 0.60 |" in text
    assert "- off ran at commit `aaaaaaaaaa`" in text and "- dynamic ran at commit `?`" in text
    experiment.plot(summary, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000
