"""The pattern task: any response length, held-out digit pairs never in training rows."""

import pytest

from gspo_lightning.data.datamodule import read_rows
from gspo_lightning.data.tasks import pattern


def test_rows_alternate_the_prompt_digits_for_length_words():
    for row in pattern.make_rows(50, seed=3, length=7):
        _, a, b = row["prompt"].split()
        assert row["target"].split() == [a, b, a, b, a, b, a]


def test_heldout_pairs_never_appear_in_training_rows():
    train = {row["prompt"] for row in pattern.make_rows(5000, seed=0, length=4)}
    heldout = {row["prompt"] for row in pattern.heldout_rows(4)}
    assert len(heldout) == len(pattern.HELDOUT_PAIRS) == 20
    assert not train & heldout and len(train) == 80  # every other ordered pair is trained on
    assert {row["prompt"] for row in pattern.make_rows(200, seed=1, split="heldout")} <= heldout


def test_reward_is_the_share_of_positions_right():
    targets = ["1 2 1 2", "1 2 1 2", "1 2 1 2", "1 2 1 2"]
    completions = ["1 2 1 2", "1 2 9 9 9 9", "1", ""]
    assert pattern.pattern_reward(["p"] * 4, completions, targets) == [1.0, 0.5, 0.25, 0.0]
    with pytest.raises(ValueError, match="targets"):
        pattern.pattern_reward(["p"], ["1"], [])


def test_builtin_data_names():
    rows, _ = read_rows("builtin:pattern", num_builtin_rows=3)
    assert len(rows) == 3 and len(rows[0]["target"].split()) == pattern.DEFAULT_LENGTH
    heldout, _ = read_rows("builtin:pattern-heldout", num_builtin_rows=5)
    assert {r["prompt"] for r in heldout} <= {r["prompt"] for r in pattern.heldout_rows()}
