"""The addition task: held-out pairs never trained on, and a strict reward on the last integer."""

from gspo_lightning.data.datamodule import read_rows
from gspo_lightning.data.tasks import addition
from gspo_lightning.data.tasks.addition import addition_reward, last_integer


def test_heldout_pairs_are_fixed_and_never_in_training_rows():
    assert len(addition.HELDOUT_PAIRS) == 30 and len(addition.TRAIN_PAIRS) == 70
    heldout, _ = read_rows("builtin:addition-heldout", seed=5)
    again, _ = read_rows("builtin:addition-heldout", seed=99)
    assert heldout == again and len(heldout) == 30  # the same evaluation set in every run
    train, _ = read_rows("builtin:addition", num_builtin_rows=2000, seed=3)
    train_prompts, heldout_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in heldout}
    assert not train_prompts & heldout_prompts and len(train_prompts) == 70
    row = heldout[0]
    a, b = addition.HELDOUT_PAIRS[0]
    assert row == {"prompt": f"What is {a} + {b}? Answer with only the number.", "answer": str(a + b)}


def test_two_digit_heldout_pairs_are_fixed_and_never_in_training_rows():
    heldout, _ = read_rows("builtin:addition-2digit-heldout", seed=5)
    assert heldout == read_rows("builtin:addition-2digit-heldout", seed=77)[0] and len(heldout) == 50
    train, _ = read_rows("builtin:addition-2digit", num_builtin_rows=3000, seed=11)
    assert len(train) == 3000 and train != read_rows("builtin:addition-2digit", num_builtin_rows=3000, seed=12)[0]
    heldout_prompts = {r["prompt"] for r in heldout}
    assert not {r["prompt"] for r in train} & heldout_prompts
    for row in train[:50] + heldout:  # two-digit operands, the sum as the answer
        a, b = (int(x) for x in row["prompt"][len("What is "):-len("? Answer with only the number.")].split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["answer"] == str(a + b)


def test_the_reward_is_the_last_integer_and_strict():
    completions = ["12", "The answer is 12.", "7 + 5 = 12", "12 is wrong, it is 13", "twelve", "", "7 + 5 =",
                   "1,2", "-12"]
    assert addition_reward(prompts=[""] * 9, completions=completions, answer=["12"] * 9) == [
        1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    # conversational completions are scored on their text
    assert addition_reward(prompts=[[]], completions=[[{"role": "assistant", "content": "It is 9"}]], answer=["9"]) == [1.0]
    assert last_integer("no digits") is None and last_integer("3 then 40") == 40
