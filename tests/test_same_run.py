"""scripts/same_run.py: the bit-for-bit comparison of two runs finds what differs and only that."""

import csv

import torch
from safetensors.torch import save_file

from tests.helpers import load_script


def write_run(folder, weight, rows):
    (folder / "hf_model").mkdir(parents=True)
    save_file({"w": weight}, str(folder / "hf_model" / "model.safetensors"))
    with open(folder / "metrics.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_compare_sees_weights_and_metrics_but_not_timings(tmp_path):
    same_run = load_script("scripts/same_run.py")
    rows = [{"step": "0", "reward/mean": "0.5", "time/step": "0.1", "perf/samples_per_s": "900"}]
    write_run(tmp_path / "a", torch.tensor([1.0, 2.0]), rows)
    write_run(tmp_path / "b", torch.tensor([1.0, 2.0]), [{**rows[0], "time/step": "0.3", "perf/samples_per_s": "300"}])
    assert same_run.compare(tmp_path / "a", tmp_path / "b") == []  # timings may differ
    write_run(tmp_path / "c", torch.tensor([1.0, 2.0 + 2**-22]), [{**rows[0], "reward/mean": "0.50001"}])
    problems = same_run.compare(tmp_path / "a", tmp_path / "c")
    assert problems == ["weight w differs", "metrics.csv row 0 reward/mean: 0.5 vs 0.50001"]
    # -0.0 and 0.0 are equal numbers but not the same bits
    write_run(tmp_path / "d", torch.tensor([-0.0]), rows)
    write_run(tmp_path / "e", torch.tensor([0.0]), rows)
    assert same_run.compare(tmp_path / "d", tmp_path / "e") == ["weight w differs"]
