"""Offline tasks: the quickstart's task is one the untrained model fails and has to learn."""

import pytest
import torch

from gspo_lightning.data.tasks import BUILTIN_DATASETS, build_tiny
from gspo_lightning.data.tasks.echo import echo_reward
from gspo_lightning.data.tasks.successor import successor_reward


def test_successor_rows_and_partial_credit():
    rows = BUILTIN_DATASETS["successor"](50, seed=3)
    for row in rows:
        digit = int(row["prompt"].split()[1])
        assert row["prompt"] == f"next {digit}" and row["target"] == str((digit + 1) % 10)
    assert successor_reward(["next 9"] * 3, ["0 0 0 0", "0 0 9", "0 0 0 0 0 7"], ["0"] * 3) == [1.0, 0.5, 1.0]


def greedy_accuracy(name, task, reward, seed):
    """Share of the 10 prompts an untrained model answers right (all four words), greedily."""
    torch.manual_seed(seed)
    model, tokenizer = build_tiny(name)
    rows = [row for row in BUILTIN_DATASETS[task](200, seed=0)]
    rows = list({row["prompt"]: row for row in rows}.values())  # one row per digit
    ids = torch.tensor([tokenizer(row["prompt"])["input_ids"] for row in rows])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    completions = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    scores = reward([r["prompt"] for r in rows], completions, [r["target"] for r in rows])
    return sum(s == 1.0 for s in scores) / len(rows)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_untrained_model_fails_the_quickstart_task_greedily(seed):
    # tied embeddings make an untrained model repeat its last token: that solves echo
    # before any training, so echo's held-out accuracy could not show learning
    assert greedy_accuracy("builtin:tiny-successor", "successor", successor_reward, seed) <= 0.2
    assert greedy_accuracy("builtin:tiny-echo", "echo", echo_reward, seed) >= 0.8
