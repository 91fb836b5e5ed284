"""The grid benchmark's bookkeeping (no timing here): medians over quiet steps only, the
FLOP count of a step, and a table that says which commit made it."""

import pytest

from tests.helpers import load_script


@pytest.fixture(scope="module")
def grid():
    return load_script("benchmarks/bench_grid.py")


def run(steps, contention, generate=0.1):
    return {"step_wall_s": steps, "step_contention": contention, "response_length_mean": [16.0] * len(steps),
            "phases": {"generate": [generate] * len(steps), "train": [0.2] * len(steps)},
            "process_peak_rss_mib": 500.0, "train_peak_rss_mib": 480.0, "baseline_rss_mib": 400.0}


def test_medians_skip_warmup_and_busy_steps(grid):
    # step 0 is warm-up; step 2 ran while a neighbour used half the cores (5x slower)
    runs = [run([9.0, 1.0, 5.0, 1.2], [0.0, 0.0, 0.5, 0.0]), run([9.0, 1.1, 1.3, 5.5], [0.0, 0.0, 0.0, 0.6])]
    clean = grid.summarize(runs, warmup=1, max_contention=0.1, use_clean=True)
    assert clean["clean"] and clean["measured_steps"] == 6 and clean["clean_steps"] == 4
    assert clean["step_s"] == pytest.approx(1.15)  # median of 1.0, 1.2, 1.1, 1.3
    assert clean["step_s_all"] == pytest.approx(1.25) and clean["step_s_min"] == 1.0
    assert clean["other"] == pytest.approx(1.15 - 0.3)  # the step minus its timed phases
    everything = grid.summarize(runs, warmup=1, max_contention=0.1, use_clean=False)
    assert not everything["clean"] and everything["step_s"] == pytest.approx(1.25)


def test_step_flops_count_each_prompt_once_and_three_passes_for_training(grid):
    shape = {"decoder_matmul_params": 1000, "hidden_size": 10, "vocab_size": 50, "layers": 2}
    flops = grid.step_flops(shape, prompts=2, group=4, prompt_tokens=3, response_tokens=2)
    dec, head, attn = 2000, 1000, 80
    prompt_pass = 2 * (3 * dec + attn * 3 * 4 / 2)
    decode = 8 * (dec + head + attn * 5)  # one step after the first token, context 3 + 1 + 1
    responses = 8 * ((dec + head + attn * 4) + (dec + head + attn * 5))
    assert flops["generate"] == pytest.approx(prompt_pass + 2 * head + decode)
    assert flops["train"] == pytest.approx(3 * (prompt_pass + responses))
    assert flops["total"] == pytest.approx(flops["generate"] + flops["train"])


def test_markdown_carries_the_stamp_and_the_ratios(grid):
    cell = {"vocab": "100", "size": "0.6M", "params_m": 0.6, "length": 16, "limit_s": 0.05,
            "gspo": {"step_s": 0.3, "generate": 0.1, "train": 0.15, "other": 0.05, "peak_rss_mib": 500.0},
            "trl": {"step_s": 0.6, "generate": 0.2, "train": 0.3, "other": 0.1, "peak_rss_mib": 1000.0}}
    report = {"stamp": {"commit": "c" * 40, "dirty_tracked_files": ["gspo_lightning/training/module.py"], "date": "today",
                        "cpu": "some CPU", "cpus": 2, "command": "python benchmarks/bench_grid.py"},
              "threads": 2, "matmul_flops_per_s": 1.5e11, "versions": {"torch": "2.13"}, "skipped": ["100-25M-128"],
              "cells": [cell]}
    text = grid.markdown(report)
    assert "c" * 40 in text and "(changed: gspo_lightning/training/module.py)" in text and "150.0 GFLOP/s" in text
    assert "| 100 | 0.6M (0.6M) | 16 | fp32 | 0.300 | 0.600 | **0.50x** |" in text  # a cell without precision: fp32
    bf16 = grid.markdown({**report, "cells": [{**cell, "precision": "bf16"}]})
    assert "| 100 | 0.6M (0.6M) | 16 | bf16 | 0.300 | 0.600 | **0.50x** |" in bf16
    assert "500 / 1000 (0.50x)" in text and "| 6.0x |" in text  # RSS ratio, ours / FLOP limit
    assert text.rstrip().endswith("100-25M-128.")


def test_the_summary_puts_each_precision_beside_the_other_and_a_later_file_wins(tmp_path):
    import json

    summary = load_script("benchmarks/grid_summary.py")

    def report(name, commit, cells):
        path = tmp_path / name
        path.write_text(json.dumps({"stamp": {"commit": commit, "date": "2026-11-29 03:00 UTC", "cpu": "AMD EPYC"},
                                    "cells": cells}))
        return str(path)

    def cell(vocab, size, length, ours, trl, precision=None):
        c = {"vocab": vocab, "size": size, "length": length, "gspo": {"step_s": ours}, "trl": {"step_s": trl}}
        return {**c, "precision": precision} if precision else c  # files before issue 56 name no precision: fp32

    old = report("old.json", "a" * 40, [cell("100", "0.6M", 16, 0.2, 0.4), cell("2k", "25M", 32, 3.0, 5.0)])
    new = report("new.json", "b" * 40, [cell("100", "0.6M", 16, 0.3, 0.4, "bf16"), cell("2k", "25M", 32, 1.0, 4.0, "fp32"),
                                        {"vocab": "32k", "size": "25M", "length": 128}])  # a cell not run: left out
    cells, _ = summary.load([old, new])
    lines = summary.table(cells).splitlines()
    assert lines[0].startswith("| vocab | model | resp. tokens | fp32 ours / TRL |") and "bf16 ours / TRL" in lines[0]
    assert lines[2] == "| 100 | 0.6M | 16 | **0.50x** | 0.200 / 0.400 | aaaaaaa | **0.75x** | 0.300 / 0.400 | bbbbbbb |"
    assert lines[3] == "| 2k | 25M | 32 | **0.25x** | 1.000 / 4.000 | bbbbbbb |  |  |  |"  # the later file's fp32
    assert lines[-1] == "fp32: 2 of 2 cells at or under 0.5x; bf16: 0 of 1 cells at or under 0.5x"


def test_the_side_by_side_table_in_the_docs_is_what_its_command_prints():
    """docs/benchmarks.md's grid_summary.py command, run as written on the committed raw files,
    prints the table the docs show."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "benchmarks.md").read_text()
    command = " ".join(re.search(r"^python benchmarks/grid_summary\.py[^\n]*\\\n[^\n]*", docs, re.M).group(0).split("\\\n"))
    command = command.split("#")[0].replace("python ", f"{sys.executable} ", 1)
    printed = subprocess.run(["bash", "-c", command], cwd=root, capture_output=True, text=True, check=True).stdout
    table = printed.split("\n\n")[0]
    assert table.count("\n") == 25 and table in docs  # a header, its rule, 24 cells
