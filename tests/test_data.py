import json
from pathlib import Path

import pytest

from gspo_lightning.data.datamodule import DataError, EndlessBatchSampler, PromptDataModule, read_rows


@pytest.fixture
def dm_factory(tiny_gsm8k):
    def make(**kwargs):
        dm = PromptDataModule(**kwargs)
        dm.tokenizer = tiny_gsm8k[1]
        return dm
    return make


def write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_parquet_json_and_datasets_folder_give_the_same_rows(tmp_path):
    rows = [{"prompt": f"question {i}", "answer": str(i)} for i in range(5)]
    jsonl = write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    (tmp_path / "d.json").write_text(json.dumps(rows))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    from datasets import Dataset
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "folder"))
    for path in (jsonl, tmp_path / "d.json", tmp_path / "d.parquet", tmp_path / "folder"):
        assert read_rows(str(path))[0] == rows


def test_malformed_row_names_file_and_line_or_is_skipped_and_counted(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": "ok"}', '{"prompt": broken', '[1, 2]', '{"prompt": "fine"}'])
    with pytest.raises(DataError, match=r"bad.jsonl:2: malformed row"):
        read_rows(path)
    rows, skipped = read_rows(path, bad_rows="skip")
    assert [r["prompt"] for r in rows] == ["ok", "fine"] and skipped == 2


def test_missing_file_and_unknown_format_are_clear(tmp_path):
    with pytest.raises(DataError, match="does not exist") as missing:
        read_rows(str(tmp_path / "nope.jsonl"))
    from gspo_lightning.data.datasets import BUILTIN_FILES
    from gspo_lightning.data.tasks import BUILTIN_DATASETS

    # every builtin data set is offered: the generated tasks and the shipped files
    assert all(f"builtin:{name}" in str(missing.value) for name in [*BUILTIN_DATASETS, *BUILTIN_FILES])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported data format '.csv'"):
        read_rows(str(tmp_path / "x.csv"))


def test_missing_prompt_column_and_empty_prompt(tmp_path, dm_factory):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "How many"}', '{"question": "no prompt"}', '{"prompt": ""}'])
    dm = dm_factory(path=path, val_size=0)
    with pytest.raises(DataError, match="row 2: cannot build a prompt"):
        dm.setup("fit")
    dm = dm_factory(path=path, bad_rows="skip", val_size=0)
    dm.setup("fit")
    assert len(dm.train_rows) == 1 and dm.stats["data/train_prompts_bad"] == 2


@pytest.mark.parametrize("mode", ["truncate_left", "truncate_right", "drop"])
def test_overlong_prompts_are_truncated_or_dropped_and_counted(tmp_path, dm_factory, mode):
    long = " ".join(["Natalia sold clips to her friends"] * 5)
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": long}), json.dumps({"prompt": "How many"})])
    dm = dm_factory(path=path, prompt_length=6, overlong_prompts=mode, val_size=0)
    dm.setup("fit")
    full = dm.tokenizer(long, add_special_tokens=False)["input_ids"]
    if mode == "drop":
        assert len(dm.train_rows) == 1 and dm.stats["data/train_prompts_dropped"] == 1
    else:
        kept = dm.train_rows[0]["prompt_ids"]
        assert kept == (full[-6:] if mode == "truncate_left" else full[:6])
        assert dm.stats["data/train_prompts_truncated"] == 1


def test_template_and_chat_template(tmp_path, dm_factory):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"question": "How many clips?", "answer": "#### 3"})])
    dm = dm_factory(path=path, prompt_template="Q: {question}\nA:", val_size=0)
    dm.setup("fit")
    assert dm.train_rows[0]["prompt_text"] == "Q: How many clips?\nA:"
    dm = dm_factory(path=path, prompt_field="question", use_chat_template=True, system_prompt="Be brief.", val_size=0)
    dm.setup("fit")
    assert dm.train_rows[0]["prompt_text"] == "system: Be brief.\nuser: How many clips?\nassistant:"
    batch = dm.collate(dm.train_rows)
    assert batch["columns"]["answer"] == ["#### 3"]


def take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_sampler_covers_every_prompt_once_per_pass_across_ranks():
    rank_batches = [take(EndlessBatchSampler(24, 3, rank=r, world_size=2, seed=1), 4) for r in range(2)]
    seen = [i for batches in rank_batches for b in batches for i in b]
    assert sorted(seen) == list(range(24))
    # the next pass is a different permutation of all prompts again
    second = [i for r in range(2) for b in take(EndlessBatchSampler(24, 3, rank=r, world_size=2, seed=1, start_batch=4), 4) for i in b]
    assert sorted(second) == list(range(24)) and second != seen


def test_sampler_resumes_exactly():
    straight = take(EndlessBatchSampler(10, 4, seed=3), 7)
    resumed = take(EndlessBatchSampler(10, 4, seed=3, start_batch=3), 4)
    assert straight[3:] == resumed


def test_sampler_shuffles_once_per_pass_and_any_batch_matches_a_fresh_sampler(monkeypatch):
    """Each step's batch reads the pass's order, shuffled once per pass: a shuffle of every row at
    each step cost ~30 ms on 20k rows (a quarter of the quickstart's step, and linear in the data)."""
    import random

    from gspo_lightning.data import datamodule

    shuffles = []

    class CountingRandom(random.Random):
        def shuffle(self, x):
            shuffles.append(len(x))
            super().shuffle(x)

    monkeypatch.setattr(datamodule.random, "Random", CountingRandom)
    sampler = EndlessBatchSampler(1000, 10, seed=5)  # 100 batches a pass
    taken = take(sampler, 250)
    assert len(shuffles) == 3  # passes 0, 1 and 2
    # out of order (a resume, a rank reading back): the same batches as samplers that never cached
    for index in (249, 3, 120, 99, 100, 3):
        assert sampler.batch(index) == EndlessBatchSampler(1000, 10, seed=5).batch(index) == taken[index]


def test_too_few_prompts_for_one_step():
    with pytest.raises(DataError, match="cannot fill one step"):
        EndlessBatchSampler(5, 4, world_size=2)


def test_builtin_task_and_unknown_builtin():
    rows, _ = read_rows("builtin:echo", num_builtin_rows=5)
    assert len(rows) == 5 and rows[0]["prompt"] == f"repeat {rows[0]['target']}"
    with pytest.raises(DataError, match="unknown builtin dataset"):
        read_rows("builtin:nope")


def test_tokenizer_comes_from_its_own_argument_not_the_module(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "repeat 7"}', '{"prompt": "repeat 3"}'])
    dm = PromptDataModule(path=path, val_size=0, tokenizer="builtin:tiny-echo")
    dm.setup("fit")
    assert dm.train_rows[0]["prompt_ids"] == dm.tokenizer("repeat 7", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="set data.tokenizer"):
        PromptDataModule(path=path, val_size=0).setup("fit")


def test_batches_carry_raw_prompts_rendered_text_columns_and_training_stats(tmp_path, dm_factory):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"question": f"How many {i}?", "answer": str(i)}) for i in range(4)])
    dm = dm_factory(path=path, prompt_field="question", use_chat_template=True, val_size=0, rollout_batch_size=2)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"prompt_ids", "prompts", "prompt_text", "columns", "stats"}
    assert all(p.startswith("How many") for p in batch["prompts"])  # before the chat template
    assert all(t.startswith("user: How many") for t in batch["prompt_text"])  # after it
    assert batch["stats"]["data/train_prompts"] == 4.0 and batch["stats"]["data/train_prompts_truncated"] == 0.0
    assert len(batch["columns"]["answer"]) == 2


def test_conversational_prompts_reach_rewards_as_messages(tmp_path, dm_factory):
    messages = [{"role": "user", "content": "How many clips?"}]
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": messages, "solution": "3"})])
    dm = dm_factory(path=path, val_size=0)
    dm.setup("fit")
    batch = dm.collate(dm.train_rows)
    assert batch["prompts"] == [messages]
    assert batch["prompt_text"] == ["user: How many clips?\nassistant:"]
    dm = dm_factory(path=path, messages_field="prompt", val_size=0)
    dm.setup("fit")
    assert dm.collate(dm.train_rows)["prompts"] == [messages]


def test_empty_file_says_it_has_no_rows(tmp_path, dm_factory):
    (tmp_path / "empty.jsonl").write_text("")
    dm = dm_factory(path=str(tmp_path / "empty.jsonl"), val_size=16)
    with pytest.raises(DataError, match="empty.jsonl has no rows"):
        dm.setup("fit")


def test_test_stage_needs_its_own_file(tmp_path, dm_factory):
    train = write_jsonl(tmp_path / "train.jsonl", ['{"prompt": "How many"}'] * 4)
    test = write_jsonl(tmp_path / "test.jsonl", ['{"prompt": "Natalia sold"}'] * 3)
    with pytest.raises(DataError, match="set data.test_path"):
        dm_factory(path=train, val_size=1).setup("test")
    dm = dm_factory(path=train, val_size=1, test_path=test)
    dm.setup("test")
    batch = next(iter(dm.test_dataloader()))
    assert batch["prompts"] == ["Natalia sold"] * 3


def test_builtin_gsm8k_is_shipped_inside_the_package():
    import gspo_lightning
    from gspo_lightning.data.datasets import BUILTIN_FILES

    package = Path(gspo_lightning.__file__).resolve().parent
    for name, path in BUILTIN_FILES.items():
        assert package in path.parents, name
        assert (path.parent / "LICENSE").read_text().startswith("MIT License")
    train, _ = read_rows("builtin:gsm8k")
    held_out, _ = read_rows("builtin:gsm8k-heldout")
    assert len(train) == 400 and len(held_out) == 100
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}


class FakeTrainer:
    def __init__(self, training):
        self.training = training


def test_resume_position_counts_only_batches_that_training_steps_used(dm_factory):
    dm = dm_factory(path="builtin:echo", val_size=0)
    dm.trainer = FakeTrainer(training=True)
    for _ in range(3):
        dm.on_after_batch_transfer({}, 0)
    dm.trainer = FakeTrainer(training=False)  # validation batches do not move the position
    dm.on_after_batch_transfer({}, 0)
    assert dm.state_dict() == {"batches_consumed": 3, "extra_batches_consumed": 0}
    resumed = dm_factory(path="builtin:echo", val_size=0)
    resumed.load_state_dict(dm.state_dict())
    assert resumed.start_batch == 3


@pytest.mark.parametrize("val_size", [None, 0])
def test_no_val_size_means_no_validation_for_generated_tasks_too(val_size):
    dm = PromptDataModule(path="builtin:echo", tokenizer="builtin:tiny-echo", val_size=val_size)
    dm.setup("fit")
    assert dm.val_rows == [] and dm.val_dataloader() == []
